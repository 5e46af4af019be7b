// Device half of the channels: LL lines (8 payload bytes and two copies of a 4-byte flag in
// 16 bytes, written by one vector store, so a reader that sees both flags sees the data) and
// bounded polling with a %globaltimer deadline. The trigger FIFO's producer: fifo_device.cuh.
#pragma once

#include <cstdint>

#include "core/gpu_layout.hpp"
#include "exchange_args.hpp"

namespace resident {
namespace gpu {

__device__ __forceinline__ uint64_t globalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The flag that marks what a round of generation g wrote (LL lines, the simple protocol's flags,
// the proxy's checks of both): g, but 1 for generation 0. Round numbers are 32-bit and wrap, so
// every 2^32 rounds with a peer a round has generation 0, and memory no round has written yet
// (zero) must not read as its lines. Generation 1 uses the other slot of the channel.
__device__ __forceinline__ uint32_t flagOf(uint32_t g) {
  return g != 0 ? g : 1u;
}

// A line of round generation g (flagOf(g) in both flag words).
__device__ __forceinline__ void storeLine(unsigned char* p, uint64_t data, uint32_t g) {
  const uint32_t flag = flagOf(g);
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p),
               "r"(static_cast<uint32_t>(data)), "r"(flag), "r"(static_cast<uint32_t>(data >> 32)),
               "r"(flag)
               : "memory");
}

// Whether the line at p is one of round generation g; its data then.
__device__ __forceinline__ bool loadLine(const unsigned char* p, uint32_t g, uint64_t& data) {
  uint32_t d0, f0, d1, f1;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d0), "=r"(f0), "=r"(d1), "=r"(f1)
               : "l"(p)
               : "memory");
  data = static_cast<uint64_t>(d0) | (static_cast<uint64_t>(d1) << 32);
  const uint32_t flag = flagOf(g);
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
// host-visible error word and raises `failed` so the other blocks stop polling. A poll is one
// load at a time: several in flight to a word of host memory saw it later (H200,
// benchmarks/probes/poll_stagger_probe.cu, docs/decisions.md).
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
    const uint64_t abort_word = loadVolatile64(reg.local + GpuLayout::kAbortWord);
    const uint64_t now = globalTimerNs();
    const bool left = peerLeft(peer, what);
    if (abort_word == 0 && now <= deadline) {
      if (!left) return false;
      // The peer left in order: what it sent before is in memory already (its host published
      // the departure after it), visible after this fence. Polled until the next check, then
      // the op gives up.
      __threadfence_system();
      deadline = now;
      return false;
    }
    const ErrorCode code =
        abort_word ? ErrorCode::kAborted : (left ? ErrorCode::kPeerLeft : ErrorCode::kTimeout);
    if (atomicCAS(&reg.state->failed, 0u, 1u) == 0u) {
      // code | op | peer + 1 | what | expected, so that zero means "no error".
      const uint64_t word = static_cast<uint64_t>(code) | (static_cast<uint64_t>(op_id) << 8) |
                            (static_cast<uint64_t>(peer + 1 & 0xffff) << 16) |
                            (static_cast<uint64_t>(what & 0xff) << 32) |
                            (static_cast<uint64_t>(expected & 0xffffff) << 40);
      storeRelease64(reg.local + GpuLayout::kErrorWord, word);
    }
    return true;
  }

  // Whether `peer` left the group (GpuLayout::kPeersLeftWord), for a wait on something that
  // peer sends (a line, a flag, a credit); not for one on this rank's proxy or own blocks.
  __device__ bool peerLeft(int peer, uint32_t what) const {
    if (what == 0 || what == kWaitFifo || peer < 0 || peer >= kMaxRanks) return false;
    return (loadVolatile64(reg.local + GpuLayout::kPeersLeftWord) >> peer) & 1;
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

}  // namespace gpu
}  // namespace resident
