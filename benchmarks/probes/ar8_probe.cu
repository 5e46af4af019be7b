// How close is the library's 8-byte all_reduce kernel to the least any kernel of this design can
// do? Two ranks as two processes on one GPU (under MPS, as the benchmark), sharing mapped host
// memory; each captures a graph of NODES back-to-back all_reduces (in place, int64 SUM, PDL as
// the library) and replays it; per-op time = replay time / NODES, median over replays, per rank.
// Variants, side by side in one run:
//   lib:          the library's collective kernel (kernels/collective_kernel.cu) with the
//                 arguments GpuCommunicator builds for this op (direct path, prefetch on)
//   lib-noprefetch: the same with RESIDENT_GPU_PREFETCH=0's arguments
//   lib-one-round: the library's one-round kernel (kernels/one_round_kernel.cu), 32 threads
//                 as GpuCommunicator launches it for 8 B
//   lib-copy(-warm): a copy of the general kernel built here, launchable with any block size;
//                 -warm reads every 64-byte line of its arguments before griddepcontrol.wait
//   min:          the least kernel: its round number from device memory and advanced before
//                 griddepcontrol.wait (as the library), then one thread loads the input, stores
//                 one LL line to the peer, polls its own, stores the sum. 256 or 32 threads.
//   min-noload:   min without the input load (the line carries a constant): the load's share
// Every variant checks the result after the last replay (2^(ops-1) * (a + b) mod 2^64).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Ikernels -Icsrc benchmarks/probes/ar8_probe.cu \
//        kernels/collective_kernel.cu kernels/one_round_kernel.cu -o ar8_probe && ./ar8_probe
//        [NODES [REPLAYS]]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "launch_device.cuh"
#include "ll_device.cuh"
#include "probe_device.cuh"
#include "probe_util.hpp"

namespace {

using probe::check;
using resident::gpu::CollectiveArgs;
using resident::gpu::DeviceState;

constexpr int kVariants = 10;
constexpr uint64_t kSlotBytes = 4096;  // one part of LL lines
constexpr uint64_t kCollIn0 = 4096;    // error / abort / FIFO-tail words before the slots
constexpr uint64_t kSegBytes = kCollIn0 + 2 * 2 * kSlotBytes;      // 2 ranks x 2 slots
constexpr size_t kSharedBytes = 4096 + kVariants * 2 * kSegBytes;  // control page, segments
constexpr uint64_t kTimeoutNs = 2000000000ull;

struct MinArgs {
  uint32_t* seq;          // device: ops done
  uint64_t* data;         // device: in and out (in place)
  unsigned char* mine;    // this rank's LL slots (mapped host memory)
  unsigned char* theirs;  // the peer's
  int* error;             // device: a wait timed out
};

template <bool Load>
__global__ void __launch_bounds__(256) minAllReduce(const __grid_constant__ MinArgs a) {
  const uint32_t g = probe::enterOp(a.seq);
  if (threadIdx.x != 0) return;
  const uint64_t v = Load ? __ldcg(reinterpret_cast<const unsigned long long*>(a.data)) : g;
  resident::gpu::storeLine(a.theirs + (g & 1) * 16, v, g);
  uint64_t peer = 0;
  if (!probe::pollLine(a.mine + (g & 1) * 16, g, peer, a.error, kTimeoutNs)) return;
  *a.data = v + peer;
}

// A copy of the library's collective kernel (kernels/collective_kernel.cu), launchable with any
// block size; Warm: before griddepcontrol.wait the block reads one word of every 64-byte line of
// the arguments it will use, so that their first reads after the wait hit the constant cache.
template <bool Warm>
__global__ void __launch_bounds__(256) libCopy(const __grid_constant__ CollectiveArgs a) {
  using namespace resident::gpu;
  __shared__ Shared sh;
  __shared__ uint32_t sink;
  if (Warm) {
    const auto* words = reinterpret_cast<const uint32_t*>(&a);
    const uint32_t used = static_cast<uint32_t>(offsetof(CollectiveArgs, peers) +
                                                sizeof(PeerPlan) * static_cast<uint32_t>(a.nranks));
    uint32_t x = 0;
    for (uint32_t i = threadIdx.x; i * 64 < used; i += blockDim.x) x ^= words[i * 16];
    *reinterpret_cast<volatile uint32_t*>(&sink) = x;  // keeps the loads
  }
  enterCollective(a, sh);
  collectiveBody<false>(a, sh);
}

struct Variant {
  const char* name;
  int kind;  // 0 lib, 1 min+load, 2 min no load, 3 lib copy, 4 lib copy warm, 5 one-round kernel
  bool prefetch;
  unsigned threads;
};

int runRank(int rank, unsigned char* shared, int nodes, int replays) {
  check(cudaSetDevice(0), "device");
  auto* ctl = reinterpret_cast<probe::TwoRankControl*>(shared);
  unsigned char* shared_d = probe::registerShared(shared, kSharedBytes);
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const Variant variants[kVariants] = {
      {"lib", 0, true, 256},       {"lib-one-round", 5, true, 32},
      {"lib-copy", 3, true, 256},  {"lib-copy-warm", 4, true, 256},
      {"min", 1, true, 256},       {"min", 1, true, 32},
      {"min-noload", 2, true, 32}, {"lib-noprefetch", 0, false, 256},
      {"lib", 0, true, 256},       {"lib-one-round", 5, true, 32}};
  const uint64_t mine_init[2] = {0x1234567890abcdefull, 0x0fedcba987654321ull};
  uint64_t step = 1;
  int status = 0;
  for (int vi = 0; vi < kVariants; ++vi) {
    const Variant& v = variants[vi];
    auto seg = [&](int r) { return shared_d + 4096 + (vi * 2 + r) * kSegBytes; };
    uint64_t* data = nullptr;
    check(cudaMalloc(&data, 64), "malloc");
    check(cudaMemcpy(data, &mine_init[rank], 8, cudaMemcpyHostToDevice), "copy");
    DeviceState* state = nullptr;
    check(cudaMalloc(&state, sizeof(DeviceState)), "malloc");
    check(cudaMemset(state, 0, sizeof(DeviceState)), "memset");
    unsigned char* peer_seg = seg(1 - rank);
    check(cudaMemcpy(&state->remote[1 - rank], &peer_seg, sizeof(peer_seg), cudaMemcpyHostToDevice),
          "copy");
    int* error = nullptr;
    check(cudaMalloc(&error, 64), "malloc");
    check(cudaMemset(error, 0, 64), "memset");
    CollectiveArgs a{};
    a.reg.state = state;
    a.reg.local = seg(rank);
    a.reg.slot_bytes = kSlotBytes;
    a.reg.coll_in0 = kCollIn0;
    a.reg.chunk = 2048;
    a.reg.timeout_ns = kTimeoutNs;
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
    a.common_send = v.prefetch ? data : nullptr;
    a.common_send_bytes = v.prefetch ? 8 : 0;
    for (int p = 0; p < 2; ++p) a.peers[p] = {data, p == rank ? data : nullptr, 8, 8, 1, 0};
    MinArgs m{reinterpret_cast<uint32_t*>(state), data, seg(rank) + kCollIn0, peer_seg + kCollIn0,
              error};
    // Both ranks start each replay together; a peer that does not come ends the variant.
    bool ok = true;
    std::vector<double> per_op =
        probe::timeTwoRankGraph(s, nodes, replays, ctl, rank, step, ok, [&] {
          if (v.kind == 0) {
            check(resident::gpu::launchCollective(a, 1, s), "launch");
          } else if (v.kind == 5) {
            check(resident::gpu::launchOneRound(a, 1, v.threads, s), "launch");
          } else {
            if (v.kind >= 3)
              check(resident::gpu::launchKernel(v.kind == 3 ? libCopy<false> : libCopy<true>, a, 1,
                                                s, v.threads),
                    "launch");
            else
              check(resident::gpu::launchKernel(
                        v.kind == 1 ? minAllReduce<true> : minAllReduce<false>, m, 1, s, v.threads),
                    "launch");
          }
        });
    uint64_t got = 0;
    int err = 0;
    check(cudaMemcpy(&got, data, 8, cudaMemcpyDeviceToHost), "copy");
    check(cudaMemcpy(&err, error, 4, cudaMemcpyDeviceToHost), "copy");
    const uint64_t want = probe::allReducedWord(mine_init[0] + mine_init[1], nodes, replays);
    // min-noload carries no data: only that it completed.
    const bool correct = ok && err == 0 && (v.kind == 2 || got == want);
    probe::recordVerdict(correct, status, ctl);
    const auto at = [&](double q) { return probe::quantile(per_op, q); };
    std::printf(
        "{\"rank\": %d, \"variant\": \"%s\", \"threads\": %u, \"nodes\": %d, \"correct\": %s, "
        "\"us_per_op\": %.3f, \"p10\": %.3f, \"p90\": %.3f}\n",
        rank, v.name, v.threads, nodes, correct ? "true" : "false", at(0.5), at(0.1), at(0.9));
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
