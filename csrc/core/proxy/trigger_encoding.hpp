// The 16-byte trigger of a GPU write request, shared by its producer (a CUDA kernel, see
// kernels/fifo_device.cuh) and its consumer (the proxy, csrc/cuda/gpu_communicator_proxy.cpp), so
// that both sides encode it from one definition.
//   fst = lap | local offset << 32 | remote offset           (outbox -> the peer's GPU region)
//   snd = lap | value << 31 | kind << 29 | bytes << 7 | peer
// Both words carry the FIFO lap parity in their top bit. Kinds:
//   copy:  `bytes` of the outbox; the trigger is fenced (they are in host memory before it is).
//   lines: LL lines carrying `value` as their flag; pushed without a system-scope fence, as
//          one 16-byte store: the proxy reads the lines' flags before it posts them.
//   flag:  no bytes; the simple protocol's flags of `bytes`/kSimpleFlagStride parts whose flag
//          lines start at the remote offset, kSimpleFlagStride apart: the proxy signals
//          `value` << 32 into the upper half (+8) of each line (kernels/simple_device.cuh),
//          behind the copies it posted before.
#pragma once

#include <cstdint>

// Host-and-device functions: the only place the core needs CUDA's qualifiers.
#if defined(__CUDACC__)
#define RESIDENT_HOST_DEVICE __host__ __device__
#else
#define RESIDENT_HOST_DEVICE
#endif

namespace resident {

constexpr uint64_t kTriggerLapBit = 1ull << 63;
constexpr uint32_t kTriggerMaxPeers = 128;          // peer: 7 bits
constexpr uint64_t kTriggerMaxBytes = 1ull << 22;   // bytes: 22 bits (a slot is <= 2 MiB)
constexpr uint64_t kTriggerMaxLocal = 1ull << 31;   // local offset: 31 bits
constexpr uint64_t kTriggerMaxRemote = 1ull << 32;  // remote offset: 32 bits

enum class TriggerKind : uint32_t { kCopy = 0, kLines = 1, kFlag = 2 };

// Bytes between the simple protocol's flag lines of consecutive parts: a cache line each.
// Packed 16 bytes apart, four blocks' flags shared a line, and the writers' partial-line writes
// and the readers' polls of one line cost a 2-rank 64 KiB all_reduce on the H200 ~5.5 us
// (15.5 against 10.1 us, benchmarks/probes/ar64k_probe.cu).
constexpr uint64_t kSimpleFlagStride = 64;

// Lap 0 expects the bit set, so zero-initialised memory reads as empty.
RESIDENT_HOST_DEVICE inline uint64_t triggerLapBit(uint64_t pos, uint64_t capacity) {
  return ((pos / capacity) & 1) ? 0 : kTriggerLapBit;
}

struct GpuWriteRequest {
  uint32_t peer;
  uint64_t local_offset, remote_offset, bytes;
  TriggerKind kind;
  uint32_t value;  // lines: their flag; flag: the flag to raise (kernels/ll_device.cuh, flagOf)
};

RESIDENT_HOST_DEVICE inline uint64_t encodeWriteFst(uint64_t local_offset, uint64_t remote_offset) {
  return (local_offset << 32) | remote_offset;
}
RESIDENT_HOST_DEVICE inline uint64_t encodeWriteSnd(uint32_t peer, uint64_t bytes, TriggerKind kind,
                                                    uint32_t value) {
  return (static_cast<uint64_t>(value) << 31) | (static_cast<uint64_t>(kind) << 29) | (bytes << 7) |
         peer;
}
// Both words without their lap bits.
inline GpuWriteRequest decodeWrite(uint64_t fst_low, uint64_t snd_low) {
  GpuWriteRequest r;
  r.peer = static_cast<uint32_t>(snd_low & (kTriggerMaxPeers - 1));
  r.local_offset = fst_low >> 32;
  r.remote_offset = fst_low & 0xffffffffull;
  r.bytes = (snd_low >> 7) & (kTriggerMaxBytes - 1);
  r.kind = static_cast<TriggerKind>((snd_low >> 29) & 3);
  r.value = static_cast<uint32_t>(snd_low >> 31);
  return r;
}

}  // namespace resident
