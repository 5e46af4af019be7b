// Kernel launch with programmatic dependent launch (Hopper): the next op's kernel is
// scheduled while the previous one drains and waits in griddepcontrol.wait, so consecutive
// ops on a stream (and in a captured graph) do not pay the full launch gap.
#pragma once

#include <cuda_runtime.h>

#include <initializer_list>

#include "exchange_args.hpp"

namespace resident {
namespace gpu {

// Wait for the previous kernel on the stream to complete (its memory visible) before touching
// user buffers, then let the next one start launching. Only a kernel's own round bookkeeping,
// which the previous kernel of the stream finished before its launch_dependents, comes first.
// Launching dependents only after the wait keeps at most two kernels of a stream resident.
__device__ __forceinline__ void pdlWait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pdlLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdlEnter() {
  pdlWait();
  pdlLaunchDependents();
}

// Called by one thread in each of `count` blocks: true in exactly one, the last to pass
// `counter`. atomicInc wraps the counter back to zero in the same atomic, so a block of a
// later use can never land between a read and a reset. One block needs no counter.
__device__ __forceinline__ bool lastOf(uint32_t* counter, uint32_t count) {
  if (count <= 1) return true;
  __threadfence();
  return atomicInc(counter, count - 1) == count - 1;
}

// The same over all blocks of the grid (called once per block, at the end of a kernel).
__device__ __forceinline__ bool lastBlockOf(uint32_t* counter) {
  return lastOf(counter, gridDim.x);
}

// Loads each of `kernels` now (cudaFuncGetAttributes loads a function under lazy module
// loading); the first error, else cudaSuccess. See collective_launch.hpp's load functions.
inline cudaError_t loadFunctions(std::initializer_list<const void*> kernels) {
  cudaFuncAttributes attr;
  for (const void* k : kernels) {
    const cudaError_t err = cudaFuncGetAttributes(&attr, k);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Every kernel goes out with programmatic dependent launch: the next op's kernel is scheduled
// while the previous one drains (a graph node boundary 0.61 instead of 0.87 us on the H200, a
// probe of 200-node graphs; docs/decisions.md).
template <typename Args>
cudaError_t launchKernel(void (*kernel)(Args), const Args& args, unsigned blocks,
                         cudaStream_t stream, unsigned threads = kThreads) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args);
}

}  // namespace gpu
}  // namespace resident
