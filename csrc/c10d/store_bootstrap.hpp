// BootstrapStore on top of the group's c10d::Store (a PrefixStore per group), used once at
// communicator creation.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>

#include "core/bootstrap.hpp"

namespace resident {

class C10dStoreBootstrap : public BootstrapStore {
 public:
  explicit C10dStoreBootstrap(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    const auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }
  bool tryGet(const std::string& key, std::string* value) override {
    if (!store_->check({key})) return false;
    *value = get(key);
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace resident
