// What does the kernel boundary cost between back-to-back ops in a captured graph, and how much
// of it is griddepcontrol.wait (programmatic dependent launch: the dependent kernel is resident
// early, then waits for its predecessor's completion and memory flush)? A graph of NODES kernel
// nodes of BLOCKS x 256 threads, per-node time over many replays, per variant:
//   plain:    no PDL attribute; each kernel stores one device word.
//   pdl:      the PDL attribute; griddepcontrol.wait, then launch_dependents (as the library's
//             pdlEnter), then the store.
//   pdl-flag: the PDL attribute; launch_dependents is issued once the predecessor's word is
//             seen (a spin on device memory instead of griddepcontrol.wait), then the store.
// Each also with one uncached read of mapped host memory per kernel (+hostread), the round trip
// every op pays to see its peer's line. One JSON line per variant, microseconds per node.
//
//   nvcc -std=c++17 -O2 -arch=sm_90 -Ikernels -Icsrc scripts/pdl_chain_probe.cu -o probe && ./probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "launch_device.cuh"
#include "probe_util.hpp"

namespace {

using probe::check;

using resident::gpu::kThreads;

struct Chain {
  unsigned* counter;     // device: blocks done so far (all nodes of all replays)
  const uint64_t* host;  // mapped host memory, read once per kernel in +hostread variants
  unsigned long long* sink;
};

__device__ __forceinline__ unsigned loadAcquireGpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

struct NodeArgs {
  Chain c;
  unsigned base;
};

template <int Variant, bool HostRead>
__global__ void node(NodeArgs a) {
  const Chain& c = a.c;
  const unsigned base = a.base;
  // base: blocks the predecessors completed before this node (node index * gridDim.x, plus the
  // replays before); the predecessor is done when the counter reaches it.
  if (Variant == 1) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  } else if (Variant == 2) {
    if (threadIdx.x == 0) {
      const unsigned want = base;
      while (static_cast<int>(loadAcquireGpu(c.counter) - want) < 0) {
      }
    }
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  if (HostRead && threadIdx.x == 0) {
    uint64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(c.host) : "memory");
    if (v == 0x5a5a5a5a5a5a5a5aull) *c.sink = v;  // never: keeps the load
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c.counter, 1u);
  }
}

template <int Variant, bool HostRead>
void run(const char* name, Chain c, int nodes, int blocks, int replays, cudaStream_t s) {
  // The counter advances by nodes * blocks per replay; node i of replay r waits for
  // (r * nodes + i) * blocks. Replays are captured with base values for replay 0 and a reset of
  // the counter before each replay (a memset node), so every replay is the same.
  cudaGraph_t g;
  cudaGraphExec_t ge;
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
  check(cudaMemsetAsync(c.counter, 0, sizeof(unsigned), s), "memset");
  for (int i = 0; i < nodes; ++i) {
    // The library's own launch (kernels/launch_device.cuh), with or without the PDL attribute.
    check(resident::gpu::launchKernel(node<Variant, HostRead>,
                                      NodeArgs{c, static_cast<unsigned>(i * blocks)},
                                      static_cast<unsigned>(blocks), s, Variant != 0),
          "launch");
  }
  check(cudaStreamEndCapture(s, &g), "end capture");
  check(cudaGraphInstantiate(&ge, g, 0), "instantiate");
  std::vector<double> per_node =
      probe::timeReplays(ge, s, nodes, replays, [](int) { return true; });
  std::sort(per_node.begin(), per_node.end());
  std::printf(
      "{\"variant\": \"%s\", \"host_read\": %s, \"blocks\": %d, \"nodes\": %d, "
      "\"us_per_node\": %.3f, \"p10\": %.3f, \"p90\": %.3f}\n",
      name, HostRead ? "true" : "false", blocks, nodes, per_node[per_node.size() / 2],
      per_node[per_node.size() / 10], per_node[per_node.size() * 9 / 10]);
  std::fflush(stdout);
  check(cudaGraphExecDestroy(ge), "destroy");
  check(cudaGraphDestroy(g), "destroy");
}

}  // namespace

int main(int argc, char** argv) {
  const int nodes = argc > 1 ? std::atoi(argv[1]) : 200;
  const int replays = argc > 2 ? std::atoi(argv[2]) : 51;
  Chain c{};
  check(cudaMalloc(&c.counter, 64), "cudaMalloc");
  check(cudaMalloc(&c.sink, 64), "cudaMalloc");
  uint64_t* host = nullptr;
  check(cudaHostAlloc(&host, 4096, cudaHostAllocMapped), "cudaHostAlloc");
  host[0] = 1;
  uint64_t* host_d = nullptr;
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_d), host, 0), "pointer");
  c.host = host_d;
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  for (int blocks : {1, 16}) {
    run<0, false>("plain", c, nodes, blocks, replays, s);
    run<1, false>("pdl", c, nodes, blocks, replays, s);
    run<2, false>("pdl-flag", c, nodes, blocks, replays, s);
    run<0, true>("plain", c, nodes, blocks, replays, s);
    run<1, true>("pdl", c, nodes, blocks, replays, s);
    run<2, true>("pdl-flag", c, nodes, blocks, replays, s);
  }
  check(cudaFreeHost(host), "free");
  return 0;
}
