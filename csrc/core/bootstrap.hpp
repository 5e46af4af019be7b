// The key-value store used once, at communicator creation, to exchange descriptors
// (segment names, hosts, pids). The c10d adapter implements it on c10d::Store; unit tests
// implement it in memory. Never used on the per-op path.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace resident {

class BootstrapStore {
 public:
  virtual ~BootstrapStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key exists (the store's own timeout applies) and returns its value.
  virtual std::string get(const std::string& key) = 0;
  // Without blocking: true and the value if the key exists. The default blocks in get().
  virtual bool tryGet(const std::string& key, std::string* value) {
    *value = get(key);
    return true;
  }
  // The host whose server every rank reaches the store at (a TCPStore's), or empty: the tcp
  // transport listens on the address that routes there (tcp_address.hpp).
  virtual std::string rendezvousHost() const { return ""; }
};

// Every rank publishes `value` under `key`; returns all ranks' values, indexed by rank. Without
// `check`, each missing value is waited for in get() (the store's timeout). With it, missing
// values are polled (tryGet every millisecond) so that a rank that died is noticed: `check(r)`
// runs between polls while rank r's value is missing and throws to give up; TimeoutError after
// `timeout_ns`.
std::vector<std::string> allGatherStrings(BootstrapStore& store, int rank, int size,
                                          const std::string& key, const std::string& value,
                                          uint64_t timeout_ns = 0,
                                          const std::function<void(int)>& check = {});

}  // namespace resident
