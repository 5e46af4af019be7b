// Same-host transport: peers' inboxes are mapped into this process, so a write is a memcpy
// and a signal a release store. It plays the NIC when the proxy path is forced on one host.
#pragma once

#include <vector>

#include "core/transport/transport.hpp"

namespace resident {

class ShmTransport : public Transport {
 public:
  // `peer_inboxes[p]`: base of p's inbox mapped here (nullptr for peers not on this host).
  explicit ShmTransport(std::vector<unsigned char*> peer_inboxes)
      : inboxes_(std::move(peer_inboxes)) {}
  const char* name() const override { return "shm"; }
  void write(int peer, size_t offset, const void* src, size_t bytes) override;
  // From 1 KiB, non-temporal stores (where the CPU has them): a GPU read of a line still dirty
  // in a CPU cache is slower (proxy copy probe, H200 host: 128 KiB of lines read in 4.5 us
  // instead of 7.7).
  void writeForDevice(int peer, size_t offset, const void* src, size_t bytes,
                      size_t prefetch) override;
  // The check and the copy in one pass (copyLandedLlLines: non-temporal stores, no fence).
  uint64_t writeLandedLines(int peer, size_t offset, const unsigned char* src, uint64_t bytes,
                            uint32_t flag, uint64_t prefetch) override;
  void flushDeviceWrites() override;
  bool fusesLineCheck(int /*peer*/) const override { return true; }
  void signal(int peer, size_t offset, uint64_t value) override;
  bool directCapable(int peer) const override { return inboxes_[peer] != nullptr; }

 private:
  // Below 1 KiB a cached copy is the faster one (H200, `bash scripts/device_run.sh bench-ab`:
  // an 8 B all_reduce's 16-byte line took ~0.3 us longer end to end with non-temporal stores
  // and their fence; from 4 KiB payloads on they win, 7-24% at 64-256 KiB; the fused check and
  // copy with non-temporal stores likewise cost the 8 B cells 0.1-0.3 us).
  static constexpr size_t kStreamingMinBytes = 1024;
  std::vector<unsigned char*> inboxes_;
};

}  // namespace resident
