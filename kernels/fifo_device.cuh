// Device half of the trigger FIFO (its host half: csrc/core/proxy/fifo.hpp): the producer in
// this rank's GPU region, the trigger words of a write request
// (csrc/core/proxy/trigger_encoding.hpp) and the hand-off of a block's lines to the proxy.
#pragma once

#include <cstdint>

#include "core/gpu_layout.hpp"
#include "core/proxy/trigger_encoding.hpp"
#include "exchange_args.hpp"
#include "ll_device.cuh"

namespace resident {
namespace gpu {

// Producer of the trigger FIFO in this rank's GPU region (many blocks may push): positions
// are taken by an atomic on DeviceState::fifo_head, one or several at once ahead of the stores
// (reserveTriggers, then pushTriggerAt or pushTriggerWords).
//
// reserveTriggers: called by one thread of its warp (every caller is thread 0). The atomic is
// issued only by the warp's lowest active lane, a predicate ptxas cannot see through: it turns a
// plain atomicAdd (or atom) whose count it knows to be warp-uniform into a warp-aggregated one
// whose shuffle waits for the result at once, which put the atomic's round trip before the payload
// load instead of beside it (one-round kernel).
__device__ __forceinline__ unsigned long long reserveTriggers(const Region& reg, uint32_t n) {
  unsigned long long pos = 0;
  asm volatile(
      "{\n\t.reg .pred leader;\n\t.reg .b32 active, lowest, lane;\n\t"
      "activemask.b32 active;\n\tneg.s32 lowest, active;\n\tand.b32 lowest, lowest, active;\n\t"
      "bfind.u32 lowest, lowest;\n\tmov.u32 lane, %%laneid;\n\t"
      "setp.eq.u32 leader, lane, lowest;\n\t"
      "@leader atom.global.add.u64 %0, [%1], %2;\n\t}"
      : "+l"(pos)
      : "l"(&reg.state->fifo_head), "l"(static_cast<unsigned long long>(n))
      : "memory");
  return pos;
}

// Waits until position `pos` of the trigger FIFO is free (the proxy consumed what it held one
// lap ago), refreshing DeviceState::fifo_tail_cache from the proxy's tail word; false when the
// op gives up. Out of line: the rare path, kept out of the pushers' code; the Waiter by value,
// so that the caller's stays in registers.
inline __device__ __noinline__ bool waitFifoRoom(Waiter w, unsigned long long pos, int peer) {
  const Region& reg = w.reg;
  const unsigned long long cap = reg.fifo_mask + 1ull;
  for (uint32_t spins = 0;;) {
    const unsigned long long tail = loadVolatile64(reg.local + GpuLayout::kFifoTailWord);
    atomicMax(&reg.state->fifo_tail_cache, tail);
    if (pos - tail < cap) return true;
    if (++spins == 16) {
      spins = 0;
      if (w.shouldStop(peer, kWaitFifo, static_cast<uint32_t>(pos))) return false;
    }
  }
}

__device__ __forceinline__ unsigned long long loadTailCache(const Region& reg) {
  return *reinterpret_cast<volatile unsigned long long*>(&reg.state->fifo_tail_cache);
}

// A write request's two words without their lap bits (see core/proxy/trigger_encoding.hpp for the
// kinds). `value`: the round generation of kLines and kFlag, which the trigger carries as their
// flag (flagOf). kLines: the range holds LL lines of that round; unless the op fences its triggers
// (Region::trigger_fence) the trigger goes out as one unfenced 16-byte store and the proxy
// reads the lines' flags before posting them (a system-scope release would first wait for the
// lines to reach host memory). kFlag carries no bytes and needs no fence either. kCopy (and
// fenced kLines): `release`, the second word's release store orders every
// store of this thread (and of the block, joined by a barrier before) before the trigger.
struct TriggerWords {
  uint64_t fst, snd;
  bool release;
};

__device__ __forceinline__ TriggerWords triggerWords(const Region& reg, int peer,
                                                     uint64_t local_off, uint64_t remote_off,
                                                     uint64_t bytes, TriggerKind kind,
                                                     uint32_t value) {
  if (kind == TriggerKind::kLines && reg.trigger_fence != 0) kind = TriggerKind::kCopy;
  const bool copy = kind == TriggerKind::kCopy;
  return {encodeWriteFst(local_off, remote_off),
          encodeWriteSnd(static_cast<uint32_t>(peer), bytes, kind, copy ? 0u : flagOf(value)),
          copy};
}

// Pushes `t` at position `pos`. `tail_seen`: DeviceState::fifo_tail_cache as the caller loaded
// it, possibly earlier (it only grows, so an old value can only send the push through
// waitFifoRoom, never past a full FIFO).
__device__ __forceinline__ bool pushTriggerWords(Waiter& w, unsigned long long pos,
                                                 unsigned long long tail_seen,
                                                 const TriggerWords& t) {
  const Region& reg = w.reg;
  const unsigned long long cap = reg.fifo_mask + 1ull;
  const int peer = static_cast<int>(t.snd & (kTriggerMaxPeers - 1));
  if (pos - tail_seen >= cap && !waitFifoRoom(w, pos, peer)) return false;
  unsigned char* slot = reg.local + reg.fifo_offset + 16 * (pos & reg.fifo_mask);
  const uint64_t lap = triggerLapBit(pos, cap);
  if (!t.release) {
    asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(t.fst | lap),
                 "l"(t.snd | lap)
                 : "memory");
  } else {
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(slot), "l"(t.fst | lap) : "memory");
    storeRelease64(slot + 8, t.snd | lap);
  }
  return true;
}

// The hand-off of a block's lines to the proxy: a barrier (every line store of the block issued
// first), then thread 0 runs push() (its trigger pushes), then its warp-mates wait for it
// before they go on to poll for the lines its triggers release. Without that wait a warp whose
// lanes diverged could run its pollers first and leave thread 0's pushes a poll round trip
// (~1.3 µs of host read on the H200) behind: the one-round kernel lost 1.1-1.6 µs per op that
// way from 64 B. Block-uniform.
template <typename Push>
__device__ __forceinline__ void pushFromThread0(Push&& push) {
  __syncthreads();
  if (threadIdx.x == 0) push();
  __syncwarp();
}

// Pushes a write request at position `pos` (the words of triggerWords).
__device__ inline bool pushTriggerAt(Waiter& w, unsigned long long pos, int peer,
                                     uint64_t local_off, uint64_t remote_off, uint64_t bytes,
                                     TriggerKind kind, uint32_t value) {
  return pushTriggerWords(w, pos, loadTailCache(w.reg),
                          triggerWords(w.reg, peer, local_off, remote_off, bytes, kind, value));
}

}  // namespace gpu
}  // namespace resident
