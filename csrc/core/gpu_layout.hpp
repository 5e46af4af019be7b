// Layout of the GPU region of a rank's segment: the mapped pinned host memory that CUDA
// kernels of peers write flag-carrying lines into (direct path) or that the proxy fills on
// their behalf (proxy path). Offsets are identical on all ranks, so a write is addressed by
// (peer, offset) alone. Torch-free and CUDA-free: kernels include it too.
//
//   [control: 4 lines][trigger FIFO][coll_in: nranks x 2 slots][p2p_in: nranks x 2 slots]
//   [credit_in: nranks lines]
//
// coll_in(src): lines src wrote for collectives (lockstep rounds, parity-double-buffered).
// p2p_in(src):  lines src sent point-to-point.  credit_in(dst): per slot, the last p2p round
// dst consumed of what this rank sent it (flow control of one-directional streams).
// The outbox (proxy path only, local and not shared) mirrors coll/p2p/credit per destination:
// the proxy posts coll/p2p ranges named by triggers, and polls the credit words (the last p2p
// round this rank consumed from dst, per slot) and forwards those that changed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace resident {

struct GpuLayout {
  static constexpr uint32_t kLineBytes = 16;  // 8 B payload + two 4 B flags (LL line)
  static constexpr uint32_t kLinePayload = 8;
  static constexpr uint32_t kCollSlots = 2;  // lockstep rounds need two
  static constexpr uint32_t kP2PSlots = 2;   // credits flow-control the rest
  static constexpr uint32_t kFifoCapacity = 4096;
  static constexpr size_t kControlBytes = 256;
  // Control words (each on its own 64-byte line).
  static constexpr size_t kErrorWord = 0;   // set by a kernel that gave up (timeout)
  static constexpr size_t kAbortWord = 64;  // set by the host: kernels exit at once
  // Bit p set by the host once peer p left the group in order (destroyed it): a kernel still
  // waiting for something from p gives up. One bit per rank of a CUDA group (gpu::kMaxRanks).
  static constexpr size_t kPeersLeftWord = 72;
  static constexpr int kPeersLeftBits = 64;
  static constexpr size_t kFifoTailWord = 128;  // the proxy's consumer position

  // The chunk where RESIDENT_GPU_CHUNK_BYTES is 0 (its default): 256 KiB for a group with a
  // pair over a network transport (tcp, ib), where a round costs a proxied exchange whatever its
  // size and fewer rounds made ops from 256 KiB per peer 1.1-1.7x faster and EP steps 1.1-1.5x
  // with the decode sizes unchanged (docs/decisions.md); 64 KiB within a host, where 8 ranks
  // sharing a GPU took longer EP steps with 256 KiB. Groups of more than 16 ranks keep 64 KiB:
  // a proxied peer costs 16 chunks of pinned host memory (its inbox and outbox slots, sized for
  // LL lines), 4 MiB at 256 KiB.
  static constexpr uint32_t kHostChunk = 65536;
  static constexpr uint32_t kNetworkChunk = 262144;
  static constexpr int kNetworkChunkMaxRanks = 16;
  static uint32_t automaticChunk(bool network_pair, int nranks) {
    return network_pair && nranks <= kNetworkChunkMaxRanks ? kNetworkChunk : kHostChunk;
  }

  GpuLayout() = default;
  GpuLayout(int nranks, uint32_t chunk_bytes)
      : nranks(static_cast<size_t>(nranks)), chunk(chunk_bytes) {}

  size_t nranks = 0;
  uint32_t chunk = 0;  // payload bytes per slot (one round of one peer)

  size_t slotBytes() const { return static_cast<size_t>(chunk) / kLinePayload * kLineBytes; }
  size_t fifoOffset() const { return kControlBytes; }
  size_t collIn(int src) const {
    return fifoOffset() + size_t{kFifoCapacity} * 16 +
           static_cast<size_t>(src) * kCollSlots * slotBytes();
  }
  size_t p2pIn(int src) const {
    return collIn(static_cast<int>(nranks)) + static_cast<size_t>(src) * kP2PSlots * slotBytes();
  }
  size_t creditIn(int dst) const {
    return p2pIn(static_cast<int>(nranks)) + static_cast<size_t>(dst) * 64;
  }
  size_t totalBytes() const { return creditIn(static_cast<int>(nranks)); }

  // Outbox (proxy path): what this rank sends to `dst`, staged before the proxy posts it.
  size_t outboxStride() const { return (kCollSlots + kP2PSlots) * slotBytes() + 64; }
  size_t outColl(int dst) const { return static_cast<size_t>(dst) * outboxStride(); }
  size_t outP2P(int dst) const { return outColl(dst) + kCollSlots * slotBytes(); }
  size_t outCredit(int dst) const { return outP2P(dst) + kP2PSlots * slotBytes(); }
  size_t outboxBytes() const { return outboxStride() * nranks; }
};

}  // namespace resident
