// Can a GPU thread see a word in mapped host memory sooner by keeping several polls in flight?
// A kernel's poll of host memory (an LL line or flag the proxy wrote) is a load that waits for
// its PCIe round trip before the next one goes out, so a write lands on average half a round
// trip before the next poll reaches it. Here one GPU thread and one CPU thread ping-pong a
// counter through mapped pinned host memory (cudaHostAlloc), and the GPU side polls:
//   serial:       one load at a time, as kernels/ll_device.cuh's Waiter (k = 1);
//   stagger_same: k loads in flight to the same word, issued `gap` ns apart at the start, each
//                 reissued as soon as it returns (the stagger keeps itself);
//   stagger_copies: the same, load i polling copy i of the word (the CPU writes k copies, each
//                 in a cache line of its own), in case the GPU merges loads to one sector.
// The GPU answers by storing the counter to a second host word, which the CPU polls. One JSON
// line per variant: the round trip's median and p10/p90 (µs, CPU clock) and its half; every
// answer is checked (a wrong or missing one fails the probe, exit status 1). From the
// repository root:
//
//   nvcc -std=c++17 -O2 -arch=sm_90 -Ikernels -Icsrc benchmarks/probes/poll_stagger_probe.cu \
//     -o poll_stagger_probe
//   ./poll_stagger_probe [ITERS]
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ll_device.cuh"
#include "probe_util.hpp"

namespace {

using probe::check;

constexpr int kMaxInFlight = 8;
constexpr int kLineWords = 8;  // 64-byte lines of uint64 words
constexpr uint64_t kStop = ~0ull;

__device__ __forceinline__ void spinCycles(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// Waits until the word (or one of its copies) reaches `want`, with k loads in flight (the
// kernels' volatile load, kernels/ll_device.cuh).
// Returns the value seen.
template <int K>
__device__ uint64_t pollStaggered(const uint64_t* words, bool copies, uint64_t want,
                                  long long gap_cycles) {
  uint64_t v[K];
#pragma unroll
  for (int i = 0; i < K; ++i) {
    v[i] = resident::gpu::loadVolatile64(words + (copies ? i * kLineWords : 0));
    if (i + 1 < K) spinCycles(gap_cycles);
  }
  for (;;) {
#pragma unroll
    for (int i = 0; i < K; ++i) {
      if (v[i] >= want) return v[i];
      v[i] = resident::gpu::loadVolatile64(words + (copies ? i * kLineWords : 0));
    }
  }
}

// The GPU half: for round 1.. until the CPU posts kStop, waits for the round number and answers
// it. k in flight (1: serial), copies: k copies of the word.
__global__ void responder(const uint64_t* ask, uint64_t* answer, int k, bool copies,
                          long long gap_cycles) {
  if (threadIdx.x != 0) return;
  for (uint64_t round = 1;; ++round) {
    uint64_t seen;
    switch (k) {
      case 1:
        seen = pollStaggered<1>(ask, copies, round, gap_cycles);
        break;
      case 2:
        seen = pollStaggered<2>(ask, copies, round, gap_cycles);
        break;
      case 4:
        seen = pollStaggered<4>(ask, copies, round, gap_cycles);
        break;
      default:
        seen = pollStaggered<8>(ask, copies, round, gap_cycles);
        break;
    }
    if (seen == kStop) return;
    resident::gpu::storeVolatile64(answer, seen);
  }
}

struct Result {
  std::vector<double> rtt_us;
  bool ok = true;
};

// One variant: `iters` timed rounds after `warmup` untimed ones.
Result run(uint64_t* ask_h, const uint64_t* ask_d, volatile uint64_t* answer_h, uint64_t* answer_d,
           int k, bool copies, long long gap_cycles, int warmup, int iters) {
  const int writes = copies ? k : 1;
  for (int i = 0; i < kMaxInFlight * kLineWords; ++i) ask_h[i] = 0;
  *answer_h = 0;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  responder<<<1, 32>>>(ask_d, answer_d, k, copies, gap_cycles);
  check(cudaGetLastError(), "launch");
  Result r;
  const double give_up = probe::nowUs() + 60e6;
  for (int round = 1; round <= warmup + iters && r.ok; ++round) {
    const double t0 = probe::nowUs();
    for (int c = 0; c < writes; ++c)
      reinterpret_cast<volatile uint64_t*>(ask_h)[c * kLineWords] = static_cast<uint64_t>(round);
    while (*answer_h != static_cast<uint64_t>(round)) {
      if (probe::nowUs() > give_up) {
        r.ok = false;
        break;
      }
    }
    const double t1 = probe::nowUs();
    if (round > warmup) r.rtt_us.push_back(t1 - t0);
  }
  for (int c = 0; c < writes; ++c)
    reinterpret_cast<volatile uint64_t*>(ask_h)[c * kLineWords] = kStop;
  check(cudaDeviceSynchronize(), "responder");
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20000;
  const int warmup = 1000;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  check(cudaSetDeviceFlags(cudaDeviceMapHost), "flags");
  uint64_t *ask_h = nullptr, *answer_h = nullptr, *ask_d = nullptr, *answer_d = nullptr;
  check(cudaHostAlloc(reinterpret_cast<void**>(&ask_h), 4096, cudaHostAllocMapped), "alloc");
  check(cudaHostAlloc(reinterpret_cast<void**>(&answer_h), 4096, cudaHostAllocMapped), "alloc");
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ask_d), ask_h, 0), "pointer");
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&answer_d), answer_h, 0), "pointer");
  int clock_khz = 0;
  check(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0), "clock");
  int status = 0;
  struct Variant {
    const char* name;
    int k;
    bool copies;
    int gap_ns;
  };
  std::vector<Variant> variants = {{"serial", 1, false, 0}};
  for (int k : {2, 4, 8})
    for (int gap : {150, 300, 600}) {
      if (k * gap > 2400) continue;  // past a round trip's worth of stagger
      variants.push_back({"stagger_same", k, false, gap});
      variants.push_back({"stagger_copies", k, true, gap});
    }
  variants.push_back({"serial_again", 1, false, 0});
  for (const Variant& v : variants) {
    const long long gap_cycles = static_cast<long long>(v.gap_ns) * clock_khz / 1000000;
    Result r = run(ask_h, ask_d, answer_h, answer_d, v.k, v.copies, gap_cycles, warmup, iters);
    std::sort(r.rtt_us.begin(), r.rtt_us.end());
    const double med = probe::quantile(r.rtt_us, 0.5);
    std::printf(
        "{\"probe\": \"poll_stagger\", \"variant\": \"%s\", \"in_flight\": %d, \"gap_ns\": %d, "
        "\"round_trip_us\": %.3f, \"p10_us\": %.3f, \"p90_us\": %.3f, \"one_way_us\": %.3f, "
        "\"samples\": %zu, \"ok\": %s}\n",
        v.name, v.k, v.gap_ns, med, probe::quantile(r.rtt_us, 0.1), probe::quantile(r.rtt_us, 0.9),
        med / 2, r.rtt_us.size(), r.ok ? "true" : "false");
    if (!r.ok || r.rtt_us.size() != static_cast<size_t>(iters)) status = 1;
  }
  check(cudaFreeHost(ask_h), "free");
  check(cudaFreeHost(answer_h), "free");
  return status;
}
