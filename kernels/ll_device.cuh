// Device half of the channels: LL lines (8 payload bytes and two copies of a 4-byte flag in
// 16 bytes, written by one vector store, so a reader that sees both flags sees the data),
// bounded polling with a %globaltimer deadline, and the trigger FIFO producer.
#pragma once

#include <cstdint>

#include "core/trigger_encoding.hpp"
#include "exchange_args.hpp"

namespace resident {
namespace gpu {

__device__ __forceinline__ uint64_t globalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void storeLine(unsigned char* p, uint64_t data, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p),
               "r"(static_cast<uint32_t>(data)), "r"(flag), "r"(static_cast<uint32_t>(data >> 32)),
               "r"(flag)
               : "memory");
}

__device__ __forceinline__ bool loadLine(const unsigned char* p, uint32_t flag, uint64_t& data) {
  uint32_t d0, f0, d1, f1;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
               : "l"(p)
               : "memory");
  data = static_cast<uint64_t>(d0) | (static_cast<uint64_t>(d1) << 32);
  return f0 == flag && f1 == flag;
}

__device__ __forceinline__ uint64_t loadVolatile64(const void* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// A load with acquire semantics at system scope: the loads after it (this thread's, and the
// block's after a barrier) see what the writer stored before its release (a system-scope fence
// and the flag store, or the proxy's transport signal). Cheaper than a volatile load followed by
// a system-scope fence, which also waits for this thread's own stores still in flight (H200:
// ~2 us of a 64 KiB all_reduce, benchmarks/probes/ar64k_probe.cu).
__device__ __forceinline__ uint64_t loadAcquire64(const void* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// A store the kernel issues at once (not kept in a register or merged): a payload word or a
// credit word in mapped host memory. Global space stated, as for the loads.
__device__ __forceinline__ void storeVolatile64(void* p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void storeRelease64(void* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Up to 8 bytes of user memory (device) as one word; 8-, 4- and 2-byte pieces at their
// alignment in one access, other tails and unaligned data bytewise (out of line: rare, and
// its unrolled loop would sit between the hot path's instructions). Loads go to L2 (__ldcg),
// bypassing L1.
inline __device__ __noinline__ uint64_t loadBytewise(const unsigned char* p, uint32_t n) {
  uint64_t v = 0;
  for (uint32_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(__ldcg(p + i)) << (8 * i);
  return v;
}
__device__ __forceinline__ uint64_t loadBytes(const unsigned char* p, uint32_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (n == 8 && (a & 7) == 0) return __ldcg(reinterpret_cast<const unsigned long long*>(p));
  if (n == 4 && (a & 3) == 0) return __ldcg(reinterpret_cast<const unsigned int*>(p));
  if (n == 2 && (a & 1) == 0) return __ldcg(reinterpret_cast<const unsigned short*>(p));
  return loadBytewise(p, n);
}
inline __device__ __noinline__ void storeBytewise(unsigned char* p, uint64_t v, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
__device__ __forceinline__ void storeBytes(unsigned char* p, uint64_t v, uint32_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (n == 8 && (a & 7) == 0) {
    *reinterpret_cast<uint64_t*>(p) = v;
  } else if (n == 4 && (a & 3) == 0) {
    *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(v);
  } else if (n == 2 && (a & 1) == 0) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v);
  } else {
    storeBytewise(p, v, n);
  }
}

// What a kernel that gave up was waiting for (the error word's bits 32-39).
constexpr uint32_t kWaitLine = 1, kWaitWord = 2, kWaitFlag = 3, kWaitFifo = 4, kWaitCredit = 5;

// Waiting with a deadline. A block that gives up records why (the first one wins) in the
// host-visible error word and raises `failed` so the other blocks stop polling.
struct Waiter {
  const Region& reg;
  uint64_t deadline;
  uint32_t op_id;

  __device__ Waiter(const Region& r, uint32_t op) : reg(r), op_id(op) {
    deadline = globalTimerNs() + r.timeout_ns;
  }

  // Called every few hundred polls: true when the op must give up. `what` (WaitKind) and
  // `expected` (its low 24 bits: the flag or round awaited) go into the error word.
  __device__ bool shouldStop(int peer, uint32_t what = 0, uint32_t expected = 0) {
    if (*reinterpret_cast<volatile uint32_t*>(&reg.state->failed)) return true;
    const uint64_t abort_word = loadVolatile64(reg.local + 64);  // GpuLayout::kAbortWord
    const bool timed_out = globalTimerNs() > deadline;
    if (abort_word == 0 && !timed_out) return false;
    const ErrorCode code = abort_word ? ErrorCode::kAborted : ErrorCode::kTimeout;
    if (atomicCAS(&reg.state->failed, 0u, 1u) == 0u) {
      // code | op | peer + 1 | what | expected, so that zero means "no error".
      const uint64_t word = static_cast<uint64_t>(code) | (static_cast<uint64_t>(op_id) << 8) |
                            (static_cast<uint64_t>(peer + 1 & 0xffff) << 16) |
                            (static_cast<uint64_t>(what & 0xff) << 32) |
                            (static_cast<uint64_t>(expected & 0xffffff) << 40);
      storeRelease64(reg.local + 0, word);  // GpuLayout::kErrorWord
    }
    return true;
  }

  // Polls until ready() holds, checking every 128 polls whether to give up; false then.
  template <typename Ready>
  __device__ __forceinline__ bool until(Ready&& ready, int peer, uint32_t what = 0,
                                        uint32_t expected = 0) {
    for (uint32_t spins = 0; !ready();) {
      if (++spins == 128) {
        spins = 0;
        if (shouldStop(peer, what, expected)) return false;
      }
    }
    return true;
  }

  // Polls one line until it carries `flag`; false when giving up.
  __device__ bool line(const unsigned char* p, uint32_t flag, uint64_t& data, int peer) {
    return until([&] { return loadLine(p, flag, data); }, peer, kWaitLine, flag);
  }

  // Polls one 8-byte word until it equals `expected`; false when giving up.
  __device__ bool word(const unsigned char* p, uint64_t expected, int peer) {
    return until([&] { return loadVolatile64(p) == expected; }, peer, kWaitWord,
                 static_cast<uint32_t>(expected));
  }

  // The same with acquire loads (loadAcquire64): for a flag that releases data stored before it.
  __device__ bool acquireWord(const unsigned char* p, uint64_t expected, int peer) {
    return until([&] { return loadAcquire64(p) == expected; }, peer, kWaitFlag,
                 static_cast<uint32_t>(expected >> 32));
  }
};

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
    const unsigned long long tail = loadVolatile64(reg.local + 128);  // kFifoTailWord
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

// A write request's two words without their lap bits (see core/trigger_encoding.hpp for the
// kinds). kLines: the range holds LL lines carrying `value`; unless the op fences its triggers
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
          encodeWriteSnd(static_cast<uint32_t>(peer), bytes, kind, copy ? 0u : value), copy};
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
