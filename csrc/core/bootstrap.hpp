// The key-value store used once, at communicator creation, to exchange descriptors
// (segment names, hosts, pids). The c10d adapter implements it on c10d::Store; unit tests
// implement it in memory. Never used on the per-op path.
#pragma once

#include <string>
#include <vector>

namespace resident {

class BootstrapStore {
 public:
  virtual ~BootstrapStore() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key exists (the store's own timeout applies) and returns its value.
  virtual std::string get(const std::string& key) = 0;
};

// Every rank publishes `value` under `key`; returns all ranks' values, indexed by rank.
std::vector<std::string> allGatherStrings(BootstrapStore& store, int rank, int size,
                                          const std::string& key, const std::string& value);

}  // namespace resident
