// Where a kernel's slots and words are: offsets in a rank's GPU region (what peers write into)
// and in its proxy outbox (what the proxy posts for it), per peer and slot. The device half of
// core/gpu_layout.hpp: the host puts the layout's bases into Region (setRegionLayout), and
// these functions compute the rest as GpuLayout does (tests/cpp/test_region_offsets.cpp checks
// every offset against it). Host and device code.
#pragma once

#include <cstdint>

#include "core/gpu_layout.hpp"
#include "exchange_args.hpp"
#include "host_device.hpp"

namespace resident {
namespace gpu {

// Host only: the layout's bases into `reg` (what the functions below start from).
inline void setRegionLayout(Region& reg, const GpuLayout& lay) {
  reg.slot_bytes = lay.slotBytes();
  reg.coll_in0 = lay.collIn(0);
  reg.p2p_in0 = lay.p2pIn(0);
  reg.credit_in0 = lay.creditIn(0);
  reg.out_stride = lay.outboxStride();
  reg.out_p2p0 = lay.outP2P(0);
  reg.out_credit0 = lay.outCredit(0);
  reg.chunk = lay.chunk;
  reg.fifo_offset = lay.fifoOffset();
  reg.fifo_mask = GpuLayout::kFifoCapacity - 1;
}

// In a rank's region: slot `slot` of the collective rounds that rank `src` writes to it.
RESIDENT_HOST_DEVICE_INLINE uint64_t collInOffset(const Region& reg, int src, uint32_t slot) {
  return reg.coll_in0 +
         (static_cast<uint64_t>(src) * GpuLayout::kCollSlots + slot) * reg.slot_bytes;
}

// In a rank's region: slot `slot` of the point-to-point rounds that rank `src` sends it.
RESIDENT_HOST_DEVICE_INLINE uint64_t p2pInOffset(const Region& reg, int src, uint32_t slot) {
  return reg.p2p_in0 + (static_cast<uint64_t>(src) * GpuLayout::kP2PSlots + slot) * reg.slot_bytes;
}

// In a rank's region: the credit word, for slot `slot`, of what it sends rank `dst` (the last
// round `dst` consumed from that slot).
RESIDENT_HOST_DEVICE_INLINE uint64_t creditInOffset(const Region& reg, int dst, uint32_t slot) {
  return reg.credit_in0 + static_cast<uint64_t>(dst) * 64 + 8ull * slot;
}

// In the outbox, what goes to rank `dst`: collective slot `slot`, point-to-point slot `slot`,
// and the credit word returned for slot `slot` (the proxy forwards it into dst's creditIn).
RESIDENT_HOST_DEVICE_INLINE uint64_t outCollOffset(const Region& reg, int dst, uint32_t slot) {
  return static_cast<uint64_t>(dst) * reg.out_stride + slot * reg.slot_bytes;
}
RESIDENT_HOST_DEVICE_INLINE uint64_t outP2POffset(const Region& reg, int dst, uint32_t slot) {
  return reg.out_p2p0 + static_cast<uint64_t>(dst) * reg.out_stride + slot * reg.slot_bytes;
}
RESIDENT_HOST_DEVICE_INLINE uint64_t outCreditOffset(const Region& reg, int dst, uint32_t slot) {
  return reg.out_credit0 + static_cast<uint64_t>(dst) * reg.out_stride + 8ull * slot;
}

}  // namespace gpu
}  // namespace resident
