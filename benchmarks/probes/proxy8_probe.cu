// How close can the proxy path's 8-byte all_reduce come to the floor, and where does the
// library spend the rest? Two ranks as two processes on one GPU (under MPS, as the benchmark),
// sharing mapped host memory; each has a proxy thread of its own, pinned as the library pins it
// (the top allowed CPUs). Each rank captures a graph of NODES back-to-back all_reduces (in place,
// int64 SUM, PDL as the library) and replays it; per-op time = replay time / NODES, median over
// replays, per rank. Variants, side by side in one run:
//   direct:        the least kernel, storing its LL line straight into the peer's slot (the
//                  direct path; the reference)
//   line:          the least kernel stores its line to its own outbox; the proxy polls that
//                  line and copies it (one 16-byte store) into the peer's slot: the least
//                  proxy path (no trigger at all)
//   line-nt:       the same with a non-temporal store and an sfence
//   trigger:       the least kernel stores its line to the outbox, then an unfenced 16-byte
//                  trigger to the FIFO (the library's encoding); the proxy pops it, checks the
//                  line's flags and copies it (the library's protocol, least code)
//   trigger-atomic: `trigger` with the position taken by an atomicAdd on a device counter,
//                  issued before the input load (as the library reserves positions)
//   trigger-atomic-tail: the same, then a volatile load of a device word (the library's
//                  cached FIFO tail, read before the trigger for flow control)
//   trigger-atomic-tail-early: the tail word loaded right after the atomic is issued
//   trigger-bigargs: trigger-atomic-tail-early with a kernel parameter as large as the library's
//                  (CollectiveArgs: its launch copies ~2 KiB of arguments)
//   trigger-waiter: trigger-atomic-tail-early polling through the library's Waiter (the abort
//                  word in host memory read every 128 polls)
//   like-*:        trigger-waiter with one library feature at a time (all of them in like-all):
//                  barrier: a __syncthreads between the line and the trigger; slots: the
//                  library's slot layout (consecutive ops 4 KiB apart, not 16 B); reload: the
//                  input loaded again after the trigger
//   lib:           the library's collective kernel with the peer proxied (the arguments
//                  GpuCommunicator builds for this op), served by the same least proxy as
//                  `trigger`: the kernel's share of the library's proxy-path time
//   lib-one-round: the library's one-round kernel with the peer proxied, the same proxy
//   lib-64, lib-one-round-64: the same two with 64 B (8 lines) instead of 8 B
//   lib-direct, lib-one-round-direct: the library's kernels on the direct path (references)
// Every variant checks the result after the last replay (2^(ops-1) * (a + b) mod 2^64).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Ikernels -Icsrc benchmarks/probes/proxy8_probe.cu \
//        kernels/collective_kernel.cu kernels/one_round_kernel.cu -o proxy8_probe && ./proxy8_probe
//        [NODES [REPLAYS]]
#include <cuda_runtime.h>
#include <emmintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "collective_launch.hpp"
#include "core/proxy/fifo.hpp"
#include "core/proxy/trigger_encoding.hpp"
#include "launch_device.cuh"
#include "ll_device.cuh"
#include "probe_device.cuh"
#include "probe_util.hpp"

namespace {

using probe::check;
using resident::gpu::CollectiveArgs;
using resident::gpu::DeviceState;

constexpr int kVariants = 21;
constexpr uint64_t kSlotBytes = 4096;  // one part of LL lines
constexpr uint64_t kFifoOffset = 256;  // after the error / abort / FIFO-tail words
constexpr uint32_t kFifoSlots = 256;
constexpr uint64_t kCollIn0 = kFifoOffset + 16ull * kFifoSlots;
constexpr uint64_t kRegionBytes = kCollIn0 + 2 * 2 * kSlotBytes;  // 2 ranks x 2 slots
constexpr uint64_t kOutStride = 2 * kSlotBytes;                   // outbox per destination
constexpr uint64_t kOutboxBytes = 2 * kOutStride;
constexpr uint64_t kRankBytes = kRegionBytes + kOutboxBytes;
constexpr size_t kSharedBytes = 4096 + kVariants * 2 * kRankBytes;  // control page, segments
constexpr uint64_t kTimeoutNs = 2000000000ull;

enum Kind {
  kDirect,
  kLine,
  kLineNt,
  kTrigger,
  kTriggerAtomic,
  kTriggerAtomicTail,
  kTriggerAtomicTailEarly,
  kTriggerBigArgs,
  kTriggerWaiter,
  kLike0,
  kLikeBarrier,
  kLikeSlots,
  kLikeReload,
  kLikeAll,
  kLib,
  kLibOneRound,
  kLibDirect,
  kLibOneRoundDirect
};

bool proxied(Kind k) {
  return k != kDirect && k != kLibDirect && k != kLibOneRoundDirect;
}

struct Variant {
  const char* name;
  Kind kind;
  uint32_t words = 1;  // int64 elements of the all_reduce (lib and lib-one-round only)
};

struct MinArgs {
  uint32_t* seq;                   // device: ops done
  uint64_t* data;                  // device: in and out (in place)
  unsigned char* mine;             // this rank's slot lines from the peer (mapped host memory)
  unsigned char* theirs;           // direct: the peer's slot lines from this rank
  unsigned char* outbox;           // proxied: this rank's outbox lines to the peer
  unsigned char* fifo;             // trigger: this rank's FIFO slots
  unsigned long long* fifo_head;   // device: trigger-atomic*: the position counter
  unsigned long long* tail_cache;  // device: trigger-atomic-tail*: the word loaded before
  int peer;
  int* error;                 // device: a wait timed out
  resident::gpu::Region reg;  // trigger-waiter: the library's region, for its Waiter
};

struct BigArgs {  // MinArgs padded to the size of the library's kernel parameter
  MinArgs m;
  unsigned char pad[sizeof(CollectiveArgs) - sizeof(MinArgs)];
};

// The trigger for the line at offset `line` (of the outbox and of the peer's slots alike), at
// FIFO position `pos`: one unfenced 16-byte store in the library's encoding. `tail`: a FIFO tail
// the variant loaded (compared, as the library does before a push, never reached).
__device__ __forceinline__ void storeTrigger(const MinArgs& a, unsigned long long pos,
                                             unsigned long long tail, uint64_t line, uint32_t g) {
  if (pos - tail >= (1ull << 40)) *a.error = 2;
  const uint64_t lap = resident::triggerLapBit(pos, kFifoSlots);
  const uint64_t fst = resident::encodeWriteFst(line, line) | lap;
  const uint64_t snd = resident::encodeWriteSnd(static_cast<uint32_t>(a.peer), 16,
                                                resident::TriggerKind::kLines, g) |
                       lap;
  unsigned char* slot = a.fifo + 16 * (pos % kFifoSlots);
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(fst), "l"(snd)
               : "memory");
}

template <Kind K>
__device__ __forceinline__ void minBody(const MinArgs& a) {
  const uint32_t g = probe::enterOp(a.seq);
  if (threadIdx.x != 0) return;
  const uint64_t line = (g & 1) * 16;
  constexpr bool kEarly = K == kTriggerAtomicTailEarly || K == kTriggerWaiter;
  constexpr bool kAtomic = K == kTriggerAtomic || K == kTriggerAtomicTail || kEarly;
  unsigned long long pos = g - 1;  // one trigger per op
  if (kAtomic) pos = atomicAdd(a.fifo_head, 1ull);
  unsigned long long tail = 0;
  if (kEarly) tail = *reinterpret_cast<volatile unsigned long long*>(a.tail_cache);
  const uint64_t v = __ldcg(reinterpret_cast<const unsigned long long*>(a.data));
  if (K == kDirect) {
    resident::gpu::storeLine(a.theirs + line, v, g);
  } else {
    resident::gpu::storeLine(a.outbox + line, v, g);
    if (K == kTriggerAtomicTail)
      tail = *reinterpret_cast<volatile unsigned long long*>(a.tail_cache);
    if (K != kLine && K != kLineNt) storeTrigger(a, pos, tail, line, g);
  }
  uint64_t peer = 0;
  if (K == kTriggerWaiter) {
    resident::gpu::Waiter w(a.reg, 0);
    if (!w.line(a.mine + line, g, peer, a.peer)) {
      *a.error = 1;
      return;
    }
  } else if (!probe::pollLine(a.mine + line, g, peer, a.error, kTimeoutNs)) {
    return;
  }
  *a.data = v + peer;
}

template <Kind K>
__global__ void __launch_bounds__(32) minAllReduce(const __grid_constant__ MinArgs a) {
  minBody<K>(a);
}

enum LikeFlags { kFlagBarrier = 1, kFlagSlots = 2, kFlagReload = 4 };

template <int F>
__global__ void __launch_bounds__(32) libLike(const __grid_constant__ MinArgs a) {
  const uint32_t g = probe::enterOp(a.seq);
  const uint64_t line = (F & kFlagSlots) ? ((g - 1) & 1) * kSlotBytes : (g & 1) * 16;
  unsigned long long pos = 0, tail = 0;
  if (threadIdx.x == 0) {
    pos = atomicAdd(a.fifo_head, 1ull);
    tail = *reinterpret_cast<volatile unsigned long long*>(a.tail_cache);
  }
  resident::gpu::Waiter w(a.reg, 0);
  uint64_t v = 0;
  if (threadIdx.x == 0) {
    v = __ldcg(reinterpret_cast<const unsigned long long*>(a.data));
    resident::gpu::storeLine(a.outbox + line, v, g);
  }
  if (F & kFlagBarrier) __syncthreads();
  if (threadIdx.x != 0) return;
  storeTrigger(a, pos, tail, line, g);
  const uint64_t mine =
      (F & kFlagReload) ? __ldcg(reinterpret_cast<const unsigned long long*>(a.data)) : v;
  uint64_t peer = 0;
  if (!w.line(a.mine + line, g, peer, a.peer)) {
    *a.error = 1;
    return;
  }
  *a.data = mine + peer;
}

__global__ void __launch_bounds__(32) minAllReduceBig(const __grid_constant__ BigArgs b) {
  minBody<kTriggerAtomicTailEarly>(b.m);
}

bool flagsAre(const unsigned char* p, uint32_t flag) {
  const auto* w = reinterpret_cast<const uint32_t*>(p);
  return __atomic_load_n(w + 1, __ATOMIC_RELAXED) == flag &&
         __atomic_load_n(w + 3, __ATOMIC_RELAXED) == flag;
}

void copyLine(unsigned char* dst, const unsigned char* src, bool nt) {
  const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(src));
  if (nt) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), v);
    _mm_sfence();
  } else {
    _mm_store_si128(reinterpret_cast<__m128i*>(dst), v);
  }
}

// The proxy of one variant: `line`/`line-nt` poll the outbox line of the next op (flag g, in
// slot g & 1); `trigger`/`lib` pop the FIFO as the library's proxy does (TriggerRingView),
// wait for the announced lines' flags and copy them. Runs until `stop`.
struct ProxyStats {
  uint64_t pops = 0, late = 0;  // triggers; those whose lines had not all landed at the pop
  double wait_us = 0;           // time spent waiting for them
};

void proxyLoop(Kind kind, unsigned char* region, unsigned char* outbox, unsigned char* peer_region,
               std::atomic<bool>* stop, ProxyStats* stats) {
  if (kind == kLine || kind == kLineNt) {
    for (uint32_t g = 1;; ++g) {
      const unsigned char* src = outbox + (g & 1) * 16;
      while (!flagsAre(src, g))
        if (stop->load(std::memory_order_relaxed)) return;
      copyLine(peer_region + kCollIn0 + (g & 1) * 16 + 0, src, kind == kLineNt);
    }
  }
  resident::TriggerRingView ring(region + kFifoOffset, reinterpret_cast<uint64_t*>(region + 128),
                                 kFifoSlots);
  while (!stop->load(std::memory_order_relaxed)) {
    resident::Trigger t;
    if (!ring.tryPop(t)) continue;
    const resident::GpuWriteRequest r = resident::decodeWrite(t.fst, t.snd);
    const unsigned char* src = outbox + r.local_offset;
    ++stats->pops;
    uint64_t off = 0;
    while (off + 16 <= r.bytes && flagsAre(src + off, r.value)) off += 16;
    if (off + 16 <= r.bytes) {
      ++stats->late;
      const double t0 = probe::nowUs();
      for (; off + 16 <= r.bytes; off += 16)
        while (!flagsAre(src + off, r.value))
          if (stop->load(std::memory_order_relaxed)) return;
      stats->wait_us += probe::nowUs() - t0;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    unsigned char* dst = peer_region + r.remote_offset;
    if (r.bytes == 16)
      copyLine(dst, src, false);
    else
      std::memcpy(dst, src, r.bytes);
    ring.publishTail();
  }
}

// The CPU the library pins a rank's proxy to (GpuCommunicator::pinProxyNearDevice without the
// device's NUMA list): counted from the top of the allowed set.
int proxyCpu(int rank) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return -1;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  return cpus.size() < 4 ? -1 : cpus[cpus.size() - 1 - static_cast<size_t>(rank)];
}

int runRank(int rank, unsigned char* shared, int nodes, int replays) {
  check(cudaSetDevice(0), "device");
  auto* ctl = reinterpret_cast<probe::TwoRankControl*>(shared);
  unsigned char* shared_d = probe::registerShared(shared, kSharedBytes);
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const Variant variants[kVariants] = {{"direct", kDirect},
                                       {"line", kLine},
                                       {"line-nt", kLineNt},
                                       {"trigger", kTrigger},
                                       {"trigger-atomic", kTriggerAtomic},
                                       {"trigger-atomic-tail", kTriggerAtomicTail},
                                       {"trigger-atomic-tail-early", kTriggerAtomicTailEarly},
                                       {"trigger-bigargs", kTriggerBigArgs},
                                       {"trigger-waiter", kTriggerWaiter},
                                       {"like-none", kLike0},
                                       {"like-barrier", kLikeBarrier},
                                       {"like-slots", kLikeSlots},
                                       {"like-reload", kLikeReload},
                                       {"like-all", kLikeAll},
                                       {"lib", kLib},
                                       {"lib-one-round", kLibOneRound},
                                       {"lib-64", kLib, 8},
                                       {"lib-one-round-64", kLibOneRound, 8},
                                       {"lib-direct", kLibDirect},
                                       {"lib-one-round-direct", kLibOneRoundDirect},
                                       {"trigger", kTrigger}};
  const int cpu = proxyCpu(rank);
  const uint64_t mine_init[2] = {0x1234567890abcdefull, 0x0fedcba987654321ull};
  const int peer = 1 - rank;
  uint64_t step = 1;
  int status = 0;
  for (int vi = 0; vi < kVariants; ++vi) {
    const Variant& v = variants[vi];
    const uint64_t at_rank = 4096 + (vi * 2 + rank) * kRankBytes;
    const uint64_t at_peer = 4096 + (vi * 2 + peer) * kRankBytes;
    uint64_t* data = nullptr;
    check(cudaMalloc(&data, 64), "malloc");
    uint64_t init[8];
    for (uint32_t i = 0; i < 8; ++i) init[i] = mine_init[rank] + i * 0x1111ull;
    check(cudaMemcpy(data, init, sizeof(init), cudaMemcpyHostToDevice), "copy");
    const uint64_t bytes8 = 8ull * v.words;
    DeviceState* state = nullptr;
    check(cudaMalloc(&state, sizeof(DeviceState)), "malloc");
    check(cudaMemset(state, 0, sizeof(DeviceState)), "memset");
    int* error = nullptr;
    check(cudaMalloc(&error, 64), "malloc");
    check(cudaMemset(error, 0, 64), "memset");
    unsigned char* region_d = shared_d + at_rank;
    unsigned char* outbox_d = region_d + kRegionBytes;
    // The library's arguments for this op with the peer proxied (GpuCommunicator::allReduce).
    CollectiveArgs a{};
    a.reg.state = state;
    a.reg.local = region_d;
    a.reg.outbox = outbox_d;
    a.reg.slot_bytes = kSlotBytes;
    a.reg.coll_in0 = kCollIn0;
    a.reg.out_stride = kOutStride;
    a.reg.chunk = 2048;
    a.reg.fifo_mask = kFifoSlots - 1;
    a.reg.fifo_offset = kFifoOffset;
    a.reg.timeout_ns = kTimeoutNs;
    a.reg.proxied = 1ull << peer;
    // LL lines only, as the library's defaults for this op (a zeroed threshold means "always").
    a.reg.simple_above[0] = a.reg.simple_above[1] = resident::gpu::kSimpleNever;
    a.local_in = data;
    a.out = data;
    a.rank = rank;
    a.nranks = 2;
    a.mode = static_cast<uint8_t>(resident::gpu::Mode::kReduce);
    a.dtype = 5;  // int64 (kernels/reduce_device.cuh kI64)
    a.redop = 0;  // sum
    a.rounds_max = 1;
    a.parts_per_block = 1;
    a.common_send = data;  // RESIDENT_GPU_PREFETCH=1, the default
    a.common_send_bytes = bytes8;
    for (int p = 0; p < 2; ++p)
      a.peers[p] = {data, p == rank ? data : nullptr, bytes8, bytes8, 1, 0};
    CollectiveArgs a_direct = a;  // the peer's region mapped: the direct path
    a_direct.reg.proxied = 0;
    a_direct.reg.outbox = nullptr;
    unsigned char* peer_d = shared_d + at_peer;
    check(cudaMemcpy(&state->remote[peer], &peer_d, sizeof(peer_d), cudaMemcpyHostToDevice),
          "copy");
    if (v.kind == kLib || v.kind == kLibOneRound)
      check(cudaMemset(&state->remote[peer], 0, sizeof(peer_d)), "memset");
    MinArgs m{reinterpret_cast<uint32_t*>(state),
              data,
              region_d + kCollIn0 + peer * 2 * kSlotBytes,
              shared_d + at_peer + kCollIn0 + rank * 2 * kSlotBytes,
              outbox_d + peer * kOutStride,
              region_d + kFifoOffset,
              &state->fifo_head,
              &state->fifo_tail_cache,
              peer,
              error,
              a.reg};
    // The proxy: the least one, or the library-protocol one (the kernel's outbox offsets are
    // relative to the outbox, its remote offsets to the peer's region).
    std::atomic<bool> stop{false};
    ProxyStats stats;
    std::thread proxy;
    if (proxied(v.kind)) {
      unsigned char* region_h = shared + at_rank;
      unsigned char* outbox_h = region_h + kRegionBytes;
      unsigned char* peer_h = shared + at_peer;
      if (v.kind == kLine || v.kind == kLineNt) {
        outbox_h += peer * kOutStride;
        peer_h += rank * 2 * kSlotBytes;  // the line's slot in the peer's region (+ kCollIn0)
      } else if (v.kind != kLib && v.kind != kLibOneRound) {
        outbox_h += peer * kOutStride;
        peer_h += kCollIn0 + rank * 2 * kSlotBytes;
      }
      proxy = std::thread(proxyLoop, v.kind, region_h, outbox_h, peer_h, &stop, &stats);
      if (cpu >= 0) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        pthread_setaffinity_np(proxy.native_handle(), sizeof(one), &one);
      }
    }
    // Both ranks start each replay together; a peer that does not come ends the variant.
    bool ok = true;
    std::vector<double> per_op =
        probe::timeTwoRankGraph(s, nodes, replays, ctl, rank, step, ok, [&] {
          if (v.kind == kLib || v.kind == kLibDirect) {
            check(resident::gpu::launchCollective(v.kind == kLib ? a : a_direct, 1, s), "launch");
            return;
          }
          if (v.kind == kLibOneRoundDirect || v.kind == kLibOneRound) {
            check(resident::gpu::launchOneRound(v.kind == kLibOneRound ? a : a_direct, 1, 32, s),
                  "launch");
            return;
          }
          void (*kernel)(MinArgs) = minAllReduce<kLine>;
          if (v.kind == kDirect) kernel = minAllReduce<kDirect>;
          if (v.kind == kTrigger) kernel = minAllReduce<kTrigger>;
          if (v.kind == kTriggerAtomic) kernel = minAllReduce<kTriggerAtomic>;
          if (v.kind == kTriggerAtomicTail) kernel = minAllReduce<kTriggerAtomicTail>;
          if (v.kind == kTriggerAtomicTailEarly) kernel = minAllReduce<kTriggerAtomicTailEarly>;
          if (v.kind == kTriggerWaiter) kernel = minAllReduce<kTriggerWaiter>;
          if (v.kind == kLike0) kernel = libLike<0>;
          if (v.kind == kLikeBarrier) kernel = libLike<kFlagBarrier>;
          if (v.kind == kLikeSlots) kernel = libLike<kFlagSlots>;
          if (v.kind == kLikeReload) kernel = libLike<kFlagReload>;
          if (v.kind == kLikeAll) kernel = libLike<kFlagBarrier | kFlagSlots | kFlagReload>;
          if (v.kind == kTriggerBigArgs) {
            BigArgs big{};
            big.m = m;
            check(resident::gpu::launchKernel(minAllReduceBig, big, 1, s, 32), "launch");
            return;
          }
          check(resident::gpu::launchKernel(kernel, m, 1, s, 32), "launch");
        });
    uint64_t got[8] = {}, want[8];
    int err = 0;
    check(cudaMemcpy(got, data, sizeof(got), cudaMemcpyDeviceToHost), "copy");
    check(cudaMemcpy(&err, error, 4, cudaMemcpyDeviceToHost), "copy");
    stop.store(true);
    if (proxy.joinable()) proxy.join();
    bool values_ok = true;
    for (uint32_t w = 0; w < v.words; ++w) {
      want[w] =
          probe::allReducedWord(mine_init[0] + mine_init[1] + 2 * w * 0x1111ull, nodes, replays);
      values_ok = values_ok && got[w] == want[w];
    }
    const bool correct = ok && err == 0 && values_ok;
    probe::recordVerdict(correct, status, ctl);
    const auto at = [&](double q) { return probe::quantile(per_op, q); };
    std::printf(
        "{\"rank\": %d, \"variant\": \"%s\", \"proxy_cpu\": %d, \"nodes\": %d, \"correct\": %s, "
        "\"us_per_op\": %.3f, \"p10\": %.3f, \"p90\": %.3f, \"proxy_pops\": %llu, "
        "\"proxy_late\": %llu, \"proxy_wait_us_per_pop\": %.3f}\n",
        rank, v.name, proxied(v.kind) ? cpu : -1, nodes, correct ? "true" : "false", at(0.5),
        at(0.1), at(0.9), static_cast<unsigned long long>(stats.pops),
        static_cast<unsigned long long>(stats.late),
        stats.pops ? stats.wait_us / static_cast<double>(stats.pops) : 0.0);
    std::fflush(stdout);
    probe::freeDevice({data, state, error});
    if (!correct) break;
  }
  check(cudaHostUnregister(shared), "unregister");
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  return probe::twoRankGraphMain(argc, argv, kSharedBytes, runRank);
}
