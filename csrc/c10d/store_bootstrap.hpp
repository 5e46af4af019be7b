// BootstrapStore on top of the group's c10d::Store (a PrefixStore per group), used once at
// communicator creation.
#pragma once

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

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
  // The TCPStore under the group's PrefixStores, if that is what it is (torchrun's, a tcp:// or
  // env:// init_method); a FileStore or HashStore has no host.
  std::string rendezvousHost() const override {
    c10::intrusive_ptr<c10d::Store> s = store_;
    for (int depth = 0; depth < 16 && s; ++depth) {
      if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(s.get())) {
        s = prefix->getUnderlyingStore();
      } else if (auto* tcp = dynamic_cast<c10d::TCPStore*>(s.get())) {
        return tcp->getHost();
      } else {
        break;
      }
    }
    return "";
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace resident
