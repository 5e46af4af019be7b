// Where does a 2-rank 64 KiB all_reduce's time go on one GPU? Two ranks as two processes on one
// GPU (under MPS, as the benchmark) exchange 64 KiB each through mapped host memory with least
// kernels, in place, uint64 SUM, in a replayed graph of NODES back-to-back ops (PDL as the
// library); per-op time = replay time / NODES, median over replays, per rank. Every variant that
// computes the all_reduce checks every word of the result after the last replay.
//
// Variants (kVariantList):
//   mode 0, LL lines (8 payload bytes per 16-byte line): blocks B x threads x lines per thread
//     K, line k of thread t of block b at (k*B + b)*threads + t; the thread issues the poll of
//     line k-L right after storing line k, without waiting for it (L = K: every store, then
//     every poll, the library's order).
//   modes 1, 2, 3: the LL stores alone, the loads alone, both in different blocks at once.
//   mode 4, payload + flags (simpleExchange): payload words, the writer's fence, a flag per
//     block, the reader's flag poll, then the payload loads; the fence's form, the reader's
//     poll (volatile, volatile + fence, acquire) and the flags' layout are template knobs.
// Measured (H200, 2026-11-30): the link carries both directions at once, but an LL exchange pays
// them in turn whatever the order of stores and polls; payload + flags was slow in the library for
// two reasons, the reader's fence after its flag and flag lines packed four to a cache line.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Ikernels -Icsrc benchmarks/probes/ar64k_probe.cu -o
//   ar64k_probe &&
//        ./ar64k_probe [NODES [REPLAYS]]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "launch_device.cuh"
#include "ll_device.cuh"
#include "probe_device.cuh"
#include "probe_util.hpp"

namespace {

using probe::check;

constexpr uint32_t kWords = 8192;                // 64 KiB of uint64
constexpr uint64_t kSlotBytes = kWords * 16ull;  // one op's LL lines
constexpr uint64_t kSegBytes = 2 * kSlotBytes;   // two slots (ops alternate)
constexpr uint64_t kTimeoutNs = 200000000ull;    // 0.2 s

// mode: 0 the exchange; 1 stores only (each op writes its lines to the peer and polls none);
// 2 loads only (each op reads its own slot's lines once, whatever they carry): the two halves of
// the exchange's traffic alone, both ranks at once; 3 both halves at once in different blocks
// (no dependency between them: does the link carry both directions at once?); 4, 5 the payload
// + flags exchange (simpleExchange).
struct Variant {
  const char* name;
  int blocks, threads, k, lag, mode;
  int layout = 0;  // simple: simpleExchange's Layout
};
// Each variant's own segments (flags restart at 1 with every variant's fresh op counter).
// Simple variants (mode 4): k = words per thread, lag = writer fence * 10 + reader sync.
const Variant kVariantList[] = {{"ll-b32-t256", 32, 256, 1, 1, 0},
                                {"simple-b32-t256-w1-f2-acquire", 32, 256, 1, 22, 4},
                                {"simple-b32-t256-w1-f2-acquire-liblayout", 32, 256, 1, 22, 4, 1},
                                {"simple-b32-t256-w1-f2-acquire-liblayout64", 32, 256, 1, 22, 4, 2},
                                {"simple-b16-t256-w2-f2-acquire", 16, 256, 2, 22, 4},
                                {"simple-b16-t256-w2-f2-acquire-liblayout", 16, 256, 2, 22, 4, 1},
                                {"simple-b32-t256-w1-f2-acquire", 32, 256, 1, 22, 4},
                                {"simple-b32-t256-w1-f2-acquire-liblayout", 32, 256, 1, 22, 4, 1},
                                {"ll-b32-t256", 32, 256, 1, 1, 0}};
constexpr int kVariants = sizeof(kVariantList) / sizeof(kVariantList[0]);
constexpr size_t kSharedBytes = 4096 + kVariants * 2 * kSegBytes;

struct Args {
  uint32_t* seq;          // device: ops done, one counter per block
  uint64_t* data;         // device: in and out (in place), kWords
  unsigned char* mine;    // this rank's two slots (mapped host memory)
  unsigned char* theirs;  // the peer's
  int* error;             // device: a wait timed out
};

__device__ __forceinline__ void loadRaw(const unsigned char* p, uint4& v) {
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
}

template <int K, int Lag, int Mode>
__global__ void __launch_bounds__(512) exchange(const __grid_constant__ Args a) {
  // One op counter per block (every block counts the same ops); a variant that failed once
  // does nothing more, so that it ends at once instead of timing out op after op.
  const uint32_t g = probe::enterOp(a.seq + blockIdx.x);
  if (*reinterpret_cast<volatile int*>(a.error) != 0) return;
  const uint64_t slot = (g & 1) * kSlotBytes;
  const uint32_t b = blockIdx.x, nb = gridDim.x, t = threadIdx.x, nt = blockDim.x;
  uint64_t v[K];
  uint4 got[K];
#pragma unroll
  for (int k = 0; k < K; ++k)
    v[k] = __ldcg(reinterpret_cast<const unsigned long long*>(a.data) + (k * nb + b) * nt + t);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint64_t line = (k * nb + b) * nt + t;
    if (Mode != 2) resident::gpu::storeLine(a.theirs + slot + line * 16, v[k], g);
    if (Mode != 1 && k >= Lag) {
      const uint64_t earlier = ((k - Lag) * nb + b) * nt + t;
      loadRaw(a.mine + slot + earlier * 16, got[k - Lag]);
    }
  }
#pragma unroll
  for (int k = K - Lag; k < K; ++k) {
    if (Mode == 1) break;
    const uint64_t line = (k * nb + b) * nt + t;
    loadRaw(a.mine + slot + line * 16, got[k]);
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint64_t line = (k * nb + b) * nt + t;
    if (Mode == 1) {
      a.data[line] = v[k] + 1;
      continue;
    }
    uint64_t peer = static_cast<uint64_t>(got[k].x) | (static_cast<uint64_t>(got[k].z) << 32);
    if (Mode == 0 && (got[k].y != g || got[k].w != g)) {
      if (!probe::pollLine(a.mine + slot + line * 16, g, peer, a.error, kTimeoutNs)) return;
    }
    a.data[line] = v[k] + peer;
  }
}

// Mode 3: half the blocks store their lines, the other half load theirs (whatever they carry):
// both directions at once with no dependency between them.
__global__ void __launch_bounds__(512) mixedHalves(const __grid_constant__ Args a) {
  const uint32_t g = probe::enterOp(a.seq + blockIdx.x);
  if (*reinterpret_cast<volatile int*>(a.error) != 0) return;
  const uint64_t slot = (g & 1) * kSlotBytes;
  const uint32_t half = gridDim.x / 2;
  const bool storer = blockIdx.x < half;
  const uint64_t line = static_cast<uint64_t>(blockIdx.x % half) * blockDim.x + threadIdx.x;
  const uint64_t v0 = __ldcg(reinterpret_cast<const unsigned long long*>(a.data) + line);
  if (storer) {
    resident::gpu::storeLine(a.theirs + slot + line * 16, v0, g);
  } else {
    uint4 x;
    loadRaw(a.mine + slot + line * 16, x);
    a.data[line] = v0 + x.x;
  }
}

// The payload + flags protocol, least form: each thread stores its Words payload words (16-byte
// vector stores; one 8-byte store when Words is 1) into the peer's slot; the writer's fence
// (WFence): 0 none (timing only: the flag may land before the payload), 1 every thread
// fences (system scope) before the block's barrier, 2 thread 0 alone fences after it (the
// library's form: the fence is cumulative); then thread 0 raises the block's flag. The reader's
// thread 0 polls its own flag for the block (RSync: 0 volatile loads, 1 volatile loads and a
// system-scope fence after (the library's form), 2 acquire loads), a barrier, then every thread
// loads the peer's words.
template <int Words, int WFence, int RSync, int Layout = 0>
__global__ void __launch_bounds__(512) simpleExchange(const __grid_constant__ Args a) {
  const uint32_t g = probe::enterOp(a.seq + blockIdx.x);
  if (*reinterpret_cast<volatile int*>(a.error) != 0) return;
  const uint64_t slot = (g & 1) * kSlotBytes;
  const uint64_t word = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * Words;
  // Layout 0: payload from the slot's start, an 8-byte flag per block 64 bytes apart after it;
  // 1: the library's (flags first, a 16-byte line {0, g, 0, g} per block 16 bytes apart, the
  // payload from 64 KiB); 2: the library's with the flag lines 64 bytes apart.
  const uint64_t payload_off = Layout == 0 ? 0 : kWords * 8ull;
  const uint64_t flag_off = Layout == 0   ? slot + kWords * 8ull + blockIdx.x * 64ull
                            : Layout == 1 ? slot + blockIdx.x * 16ull
                                          : slot + blockIdx.x * 64ull;
  const uint64_t flag_word = Layout == 0 ? flag_off : flag_off + 8;
  const uint64_t flag_value = Layout == 0 ? g : static_cast<uint64_t>(g) << 32;
  uint64_t v[Words], peer[Words];
#pragma unroll
  for (int w = 0; w < Words; ++w)
    v[w] = __ldcg(reinterpret_cast<const unsigned long long*>(a.data) + word + w);
  unsigned char* dst = a.theirs + slot + payload_off + word * 8;
  if (Words == 1) {
    resident::gpu::storeVolatile64(dst, v[0]);
  } else {
#pragma unroll
    for (int w = 0; w + 1 < Words; w += 2)
      asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(dst + w * 8), "l"(v[w]),
                   "l"(v[w + 1])
                   : "memory");
  }
  if (WFence == 1) __threadfence_system();
  __syncthreads();
  __shared__ int stop;
  if (threadIdx.x == 0) {
    if (WFence == 2) __threadfence_system();
    if (Layout == 0)
      resident::gpu::storeVolatile64(a.theirs + flag_off, g);
    else
      resident::gpu::storeLine(a.theirs + flag_off, 0, g);
    const uint64_t deadline = resident::gpu::globalTimerNs() + kTimeoutNs;
    stop = 0;
    for (;;) {
      uint64_t f;
      if (RSync == 2)
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];"
                     : "=l"(f)
                     : "l"(a.mine + flag_word)
                     : "memory");
      else
        f = resident::gpu::loadVolatile64(a.mine + flag_word);
      if (f == flag_value) break;
      if (resident::gpu::globalTimerNs() > deadline) {
        *a.error = 1;
        stop = 1;
        break;
      }
    }
    if (RSync == 1) __threadfence_system();
  }
  __syncthreads();
  if (stop) return;
  const unsigned char* src = a.mine + slot + payload_off + word * 8;
  if (Words == 1) {
    peer[0] = resident::gpu::loadVolatile64(src);
  } else {
#pragma unroll
    for (int w = 0; w + 1 < Words; w += 2)
      asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];"
                   : "=l"(peer[w]), "=l"(peer[w + 1])
                   : "l"(src + w * 8)
                   : "memory");
  }
#pragma unroll
  for (int w = 0; w < Words; ++w) a.data[word + w] = v[w] + peer[w];
}

template <int K, int Lag, int Mode = 0>
cudaError_t launchAs(const Args& a, int blocks, int threads, cudaStream_t s) {
  return resident::gpu::launchKernel(exchange<K, Lag, Mode>, a, blocks, s, threads);
}

cudaError_t launchVariant(const Variant& v, const Args& a, cudaStream_t s) {
  if (v.mode == 3) return resident::gpu::launchKernel(mixedHalves, a, v.blocks, s, v.threads);
  if (v.mode == 4) {  // simple: k = words per thread, lag = writer fence * 10 + reader sync
    const auto simple = [&](auto kernel) {
      return resident::gpu::launchKernel(kernel, a, v.blocks, s, v.threads);
    };
    switch (v.layout * 1000 + v.k * 100 + v.lag) {
      case 210:
        return simple(simpleExchange<2, 1, 0>);
      case 220:
        return simple(simpleExchange<2, 2, 0>);
      case 221:
        return simple(simpleExchange<2, 2, 1>);
      case 222:
        return simple(simpleExchange<2, 2, 2>);
      case 200:
        return simple(simpleExchange<2, 0, 0>);
      case 420:
        return simple(simpleExchange<4, 2, 0>);
      case 422:
        return simple(simpleExchange<4, 2, 2>);
      case 120:
        return simple(simpleExchange<1, 2, 0>);
      case 121:
        return simple(simpleExchange<1, 2, 1>);
      case 122:
        return simple(simpleExchange<1, 2, 2>);
      case 1122:
        return simple(simpleExchange<1, 2, 2, 1>);
      case 2122:
        return simple(simpleExchange<1, 2, 2, 2>);
      case 1222:
        return simple(simpleExchange<2, 2, 2, 1>);
      default:
        return cudaErrorInvalidValue;
    }
  }
  if (v.mode == 1) return launchAs<1, 1, 1>(a, v.blocks, v.threads, s);
  if (v.mode == 2) return launchAs<1, 1, 2>(a, v.blocks, v.threads, s);
  switch (v.k * 100 + v.lag) {
    case 101:
      return launchAs<1, 1>(a, v.blocks, v.threads, s);
    case 201:
      return launchAs<2, 1>(a, v.blocks, v.threads, s);
    default:
      return cudaErrorInvalidValue;
  }
}

uint64_t initialWord(int rank, uint32_t i) {
  uint64_t x =
      (static_cast<uint64_t>(rank) + 1) * 0x9e3779b97f4a7c15ull ^ (i * 0xbf58476d1ce4e5b9ull);
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 29);
}

int runRank(int rank, unsigned char* shared, int nodes, int replays) {
  check(cudaSetDevice(0), "device");
  auto* ctl = reinterpret_cast<probe::TwoRankControl*>(shared);
  unsigned char* shared_d = probe::registerShared(shared, kSharedBytes);
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  std::vector<uint64_t> init(kWords), got(kWords);
  for (uint32_t i = 0; i < kWords; ++i) init[i] = initialWord(rank, i);
  uint64_t step = 1;
  int status = 0;
  for (int vi = 0; vi < kVariants; ++vi) {
    const Variant& v = kVariantList[vi];
    auto seg = [&](int r) { return shared_d + 4096 + (vi * 2 + r) * kSegBytes; };
    uint64_t* data = nullptr;
    check(cudaMalloc(&data, kWords * 8), "malloc");
    check(cudaMemcpy(data, init.data(), kWords * 8, cudaMemcpyHostToDevice), "copy");
    uint32_t* seq = nullptr;
    check(cudaMalloc(&seq, 64 * sizeof(uint32_t)), "malloc");
    check(cudaMemset(seq, 0, 64 * sizeof(uint32_t)), "memset");
    int* error = nullptr;
    check(cudaMalloc(&error, 64), "malloc");
    check(cudaMemset(error, 0, 64), "memset");
    const Args a{seq, data, seg(rank), seg(1 - rank), error};
    bool ok = true;
    std::vector<double> per_op = probe::timeTwoRankGraph(
        s, nodes, replays, ctl, rank, step, ok, [&] { check(launchVariant(v, a, s), "launch"); });
    int err = 0;
    check(cudaMemcpy(got.data(), data, kWords * 8, cudaMemcpyDeviceToHost), "copy");
    check(cudaMemcpy(&err, error, 4, cudaMemcpyDeviceToHost), "copy");
    uint32_t wrong = 0;
    for (uint32_t i = 0; i < kWords; ++i)
      wrong += got[i] != probe::allReducedWord(initialWord(0, i) + initialWord(1, i), nodes,
                                               static_cast<int>(per_op.size()));
    // The halves alone (modes 1, 2) compute no all_reduce: only that they completed.
    if (v.mode >= 1 && v.mode <= 3) wrong = 0;
    const bool correct = ok && err == 0 && wrong == 0 && static_cast<int>(per_op.size()) == replays;
    probe::recordVerdict(correct, status, ctl);
    const auto at = [&](double q) { return probe::quantile(per_op, q); };
    std::printf(
        "{\"rank\": %d, \"variant\": \"%s\", \"blocks\": %d, \"threads\": %d, "
        "\"lines_per_thread\": %d, \"lag\": %d, "
        "\"nodes\": %d, \"correct\": %s, \"wrong_words\": %u, \"us_per_op\": %.3f, \"p10\": %.3f, "
        "\"p90\": %.3f}\n",
        rank, v.name, v.blocks, v.threads, v.k, v.lag, nodes, correct ? "true" : "false", wrong,
        at(0.5), at(0.1), at(0.9));
    std::fflush(stdout);
    probe::freeDevice({data, seq, error});
    if (!correct) break;
  }
  check(cudaHostUnregister(shared), "unregister");
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  return probe::twoRankGraphMain(argc, argv, kSharedBytes, runRank);
}
