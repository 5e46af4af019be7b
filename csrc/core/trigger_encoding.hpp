// The 16-byte trigger of a GPU write request, shared by its producer (a CUDA kernel, see
// kernels/ll_device.cuh) and its consumer (the proxy, csrc/cuda/gpu_communicator.cpp), so that
// both sides encode it from one definition. fst = local offset << 32 | remote offset (outbox ->
// the peer's GPU region); snd = bytes << 24 | peer, with the top bit the FIFO lap parity.
#pragma once

#include <cstdint>

// Host-and-device functions: the only place the core needs CUDA's qualifiers.
#if defined(__CUDACC__)
#define RESIDENT_HOST_DEVICE __host__ __device__
#else
#define RESIDENT_HOST_DEVICE
#endif

namespace resident {

constexpr int kTriggerPeerBits = 24;
constexpr uint64_t kTriggerLapBit = 1ull << 63;

// Lap 0 expects the bit set, so zero-initialised memory reads as empty.
RESIDENT_HOST_DEVICE inline uint64_t triggerLapBit(uint64_t pos, uint64_t capacity) {
  return ((pos / capacity) & 1) ? 0 : kTriggerLapBit;
}

struct GpuWriteRequest {
  uint32_t peer;
  uint64_t local_offset, remote_offset, bytes;
};

RESIDENT_HOST_DEVICE inline uint64_t encodeWriteFst(uint64_t local_offset, uint64_t remote_offset) {
  return (local_offset << 32) | remote_offset;
}
RESIDENT_HOST_DEVICE inline uint64_t encodeWriteSnd(uint32_t peer, uint64_t bytes) {
  return (bytes << kTriggerPeerBits) | peer;
}
// `snd_low`: the second word without its lap bit.
inline GpuWriteRequest decodeWrite(uint64_t fst, uint64_t snd_low) {
  return GpuWriteRequest{static_cast<uint32_t>(snd_low & ((1ull << kTriggerPeerBits) - 1)),
                         fst >> 32, fst & 0xffffffffull, snd_low >> kTriggerPeerBits};
}

}  // namespace resident
