// Can a waiting kernel see a flag in mapped host memory sooner by polling several copies of it?
// A GPU thread polling host memory has one read in flight, so a line that lands just after a
// read passed it is seen only a whole round trip later. If the writer stores K copies of the
// line (at a stride) and K warps of the reader poll one copy each, their reads staggered in
// time, the line is seen after about RTT/K instead of RTT. Reads of ONE host address from many
// readers are served one after another (ll_poll_probe, session 20), so the copies are at
// different addresses; the stride says how far apart (16 B: the same 128-byte line).
//
// Two blocks of one kernel ping-pong an LL line (kernels/ll_device.cuh's store and load)
// through mapped pinned host memory (MAP_SHARED + cudaHostRegister, as the segments), ITERS
// round trips per configuration; one-way = total / (2 ITERS). Per configuration: copies K,
// stride, stagger (warp w starts polling w * STAGGER ns after the iteration's barrier). First
// the round trip of one uncached read of host memory, from one thread. One line of JSON each,
// medians over REPS runs, microseconds. From the repository root:
//
//   nvcc -std=c++17 -O2 -arch=sm_90 -Ikernels -Icsrc scripts/replica_poll_probe.cu -o probe
//   ./probe [ITERS [REPS]]
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ll_device.cuh"
#include "probe_util.hpp"

namespace {

using probe::check;
using probe::median;

using resident::gpu::globalTimerNs;

struct Result {
  unsigned long long t0, t1;
  unsigned long long loads;
};

// Round trip of one uncached 16-byte read of host memory: n dependent reads from one thread.
__global__ void readLatency(const unsigned char* host, int n, Result* out) {
  uint64_t v = 0, sum = 0;
  const unsigned long long t0 = globalTimerNs();
  for (int i = 0; i < n; ++i) {
    // The address depends on the previous value, so the reads cannot overlap.
    resident::gpu::loadLine(host + ((sum & 1) << 4), 0xffffffffu, v);
    sum += v;
  }
  const unsigned long long t1 = globalTimerNs();
  out->t0 = t0;
  out->t1 = t1;
  out->loads = sum;
}

// clock64, not %globaltimer, whose update interval may be coarser than the delays wanted
// (about 2 cycles per ns on the H200's ~1.98 GHz SM clock).
__device__ __forceinline__ void spinNs(uint32_t ns) {
  if (ns == 0) return;
  const long long until = clock64() + 2ll * ns;
  while (clock64() < until) {
  }
}

// Block 0 starts each round trip (writes ping, waits for pong), block 1 answers. In each
// block warp w < copies polls copy w (lane 0), after w * stagger_ns; the first warp to see
// its copy (a) answers, on block 1, by storing all copies of the other line with lanes
// 0..copies-1, and (b) tells the block's other warps through shared memory.
__global__ void pingPong(unsigned char* ping, unsigned char* pong, int iters, int copies,
                         int stride, uint32_t stagger_ns, uint32_t flag0, Result* out) {
  __shared__ volatile int seen;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool starter = blockIdx.x == 0;
  unsigned char* mine = starter ? pong : ping;   // polled
  unsigned char* other = starter ? ping : pong;  // written
  if (threadIdx.x == 0) seen = -1;
  __syncthreads();
  const unsigned long long t0 = globalTimerNs();
  unsigned long long loads = 0;
  for (int i = 0; i < iters; ++i) {
    const uint32_t flag = flag0 + static_cast<uint32_t>(i);
    if (starter && warp == 0 && lane < copies)
      resident::gpu::storeLine(other + static_cast<size_t>(lane) * stride, i, flag);
    if (warp < copies) {
      spinNs(warp * stagger_ns);
      bool got = false;
      while (seen < i) {
        uint64_t v = 0;
        // Lane 0 polls; the warp follows its answer (no divergence across the store below).
        bool ok = false;
        if (lane == 0) {
          ok = resident::gpu::loadLine(mine + static_cast<size_t>(warp) * stride, flag, v);
          ++loads;
        }
        ok = __shfl_sync(0xffffffffu, ok, 0);
        if (ok) {
          got = true;
          break;
        }
      }
      if (got) {
        if (lane == 0) seen = i;
        if (!starter && lane < copies)
          resident::gpu::storeLine(other + static_cast<size_t>(lane) * stride, i, flag);
      }
    }
    __syncthreads();
  }
  const unsigned long long t1 = globalTimerNs();
  if (lane == 0 && starter) atomicAdd(&out->loads, loads);
  if (threadIdx.x == 0 && starter) {
    out->t0 = t0;
    out->t1 = t1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 2000;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  const size_t bytes = 1 << 20;
  void* host = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (host == MAP_FAILED) {
    std::printf("{\"error\": \"mmap\"}\n");
    return 2;
  }
  std::memset(host, 0, bytes);
  check(cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
        "cudaHostRegister");
  unsigned char* dev = nullptr;
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), host, 0), "device pointer");
  Result* res = nullptr;
  check(cudaMalloc(&res, sizeof(Result)), "cudaMalloc");
  {
    std::vector<double> us;
    for (int r = 0; r < reps + 1; ++r) {
      readLatency<<<1, 1>>>(dev, 1000, res);
      Result h;
      check(cudaMemcpy(&h, res, sizeof h, cudaMemcpyDeviceToHost), "result");
      if (r) us.push_back((h.t1 - h.t0) / 1e3 / 1000);
    }
    std::printf("{\"section\": \"read_round_trip\", \"us\": %.3f}\n", median(us));
    std::fflush(stdout);
  }
  uint32_t flag = 1;
  unsigned char* ping = dev;
  unsigned char* pong = dev + bytes / 2;
  for (int copies : {1, 2, 4, 8}) {
    for (int stride : {16, 128, 512}) {
      if (copies == 1 && stride != 16) continue;
      for (uint32_t stagger : {0u, 100u, 200u, 300u}) {
        if (copies == 1 && stagger != 0) continue;
        std::vector<double> one_way, loads;
        for (int r = 0; r < reps + 1; ++r) {
          check(cudaMemset(res, 0, sizeof(Result)), "memset");
          pingPong<<<2, 256>>>(ping, pong, iters, copies, stride, stagger, flag, res);
          flag += iters;
          Result h;
          check(cudaMemcpy(&h, res, sizeof h, cudaMemcpyDeviceToHost), "result");
          if (r == 0) continue;
          one_way.push_back((h.t1 - h.t0) / 1e3 / (2.0 * iters));
          loads.push_back(static_cast<double>(h.loads) / iters);
        }
        std::printf(
            "{\"section\": \"ping_pong\", \"copies\": %d, \"stride\": %d, \"stagger_ns\": %u, "
            "\"one_way_us\": %.3f, \"starter_loads_per_iter\": %.1f}\n",
            copies, stride, stagger, median(one_way), median(loads));
        std::fflush(stdout);
      }
    }
  }
  check(cudaHostUnregister(host), "cudaHostUnregister");
  munmap(host, bytes);
  return 0;
}
