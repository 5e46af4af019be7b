#include "core/bootstrap.hpp"

namespace resident {

std::vector<std::string> allGatherStrings(BootstrapStore& store, int rank, int size,
                                          const std::string& key, const std::string& value) {
  store.set(key + "/" + std::to_string(rank), value);
  std::vector<std::string> out(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    out[static_cast<size_t>(r)] = r == rank ? value : store.get(key + "/" + std::to_string(r));
  }
  return out;
}

}  // namespace resident
