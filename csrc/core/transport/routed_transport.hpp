// A transport that hands each peer's writes to the transport chosen for that peer (shm for
// same-host peers, tcp for the others), for groups that mix them. Polls every network
// transport. Used only when a group needs more than one kind.
#pragma once

#include <utility>
#include <vector>

#include "core/transport/transport.hpp"

namespace resident {

class RoutedTransport : public Transport {
 public:
  // by_peer[p]: the transport of peer p (nullptr for this rank); polled: those to poll().
  RoutedTransport(std::vector<Transport*> by_peer, std::vector<Transport*> polled)
      : by_peer_(std::move(by_peer)), polled_(std::move(polled)) {}
  const char* name() const override { return "routed"; }
  void write(int peer, size_t offset, const void* src, size_t bytes) override {
    by_peer_[static_cast<size_t>(peer)]->write(peer, offset, src, bytes);
  }
  void writeForDevice(int peer, size_t offset, const void* src, size_t bytes,
                      size_t prefetch) override {
    by_peer_[static_cast<size_t>(peer)]->writeForDevice(peer, offset, src, bytes, prefetch);
  }
  uint64_t writeLandedLines(int peer, size_t offset, const unsigned char* src, uint64_t bytes,
                            uint32_t flag, uint64_t prefetch) override {
    return by_peer_[static_cast<size_t>(peer)]->writeLandedLines(peer, offset, src, bytes, flag,
                                                                 prefetch);
  }
  void flushDeviceWrites() override {
    for (Transport* t : by_peer_)
      if (t != nullptr) t->flushDeviceWrites();  // cheap when nothing is pending (an sfence)
  }
  bool fusesLineCheck(int peer) const override {
    const Transport* t = by_peer_[static_cast<size_t>(peer)];
    return t != nullptr && t->fusesLineCheck(peer);
  }
  void signal(int peer, size_t offset, uint64_t value) override {
    by_peer_[static_cast<size_t>(peer)]->signal(peer, offset, value);
  }
  void writeThenSignal(int peer, const WriteRegion* regions, int n, size_t flag_offset,
                       uint64_t value) override {
    by_peer_[static_cast<size_t>(peer)]->writeThenSignal(peer, regions, n, flag_offset, value);
  }
  bool directCapable(int peer) const override {
    const Transport* t = by_peer_[static_cast<size_t>(peer)];
    return t != nullptr && t->directCapable(peer);
  }
  void poll() override {
    for (Transport* t : polled_) t->poll();
  }
  bool registerSource(const void* base, size_t bytes) override {
    bool any = false;
    for (Transport* t : polled_) any = t->registerSource(base, bytes) || any;
    return any;
  }
  void releaseSource() override {
    for (Transport* t : polled_) t->releaseSource();
  }
  std::string peerState(int peer) const override {
    return by_peer_[static_cast<size_t>(peer)]->peerState(peer);
  }

 private:
  std::vector<Transport*> by_peer_;
  std::vector<Transport*> polled_;
};

}  // namespace resident
