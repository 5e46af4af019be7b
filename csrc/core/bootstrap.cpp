#include "core/bootstrap.hpp"

#include <time.h>

#include "core/clock.hpp"
#include "core/error.hpp"

namespace resident {

std::vector<std::string> allGatherStrings(BootstrapStore& store, int rank, int size,
                                          const std::string& key, const std::string& value,
                                          uint64_t timeout_ns,
                                          const std::function<void(int)>& check) {
  store.set(key + "/" + std::to_string(rank), value);
  std::vector<std::string> out(static_cast<size_t>(size));
  const uint64_t deadline = nowNs() + timeout_ns;
  for (int r = 0; r < size; ++r) {
    std::string& v = out[static_cast<size_t>(r)];
    const std::string k = key + "/" + std::to_string(r);
    if (r == rank) {
      v = value;
    } else if (!check) {
      v = store.get(k);
    } else {
      while (!store.tryGet(k, &v)) {
        check(r);
        if (nowNs() > deadline) {
          throw TimeoutError("resident: rank " + std::to_string(r) +
                             " did not reach process group creation step '" + key + "' within " +
                             std::to_string(timeout_ns / 1000000) + " ms (rank " +
                             std::to_string(rank) + " waited for it)");
        }
        timespec ts{0, 1000000};
        nanosleep(&ts, nullptr);
      }
    }
  }
  return out;
}

}  // namespace resident
