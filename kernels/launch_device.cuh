// Kernel launch with programmatic dependent launch (Hopper): the next op's kernel is
// scheduled while the previous one drains and waits in griddepcontrol.wait, so consecutive
// ops on a stream (and in a captured graph) do not pay the full launch gap.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
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

namespace detail {

// A driver function (CUDA 12.0's version of `name`), handed out by the runtime (no link to
// libcuda); null where this driver has none.
template <typename Fn>
Fn driverEntry(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
  return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<Fn>(p)
                                                                    : nullptr;
}

using DriverLaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);

// The driver's cuLaunchKernelEx, looked up once.
inline DriverLaunchEx driverLaunchEx() {
  static const DriverLaunchEx fn = driverEntry<DriverLaunchEx>("cuLaunchKernelEx");
  return fn;
}

constexpr int kMaxDevices = 64;  // devices whose function handles a kernel caches

// The cached handle of a kernel whose lookup failed on that device (never a real handle).
inline CUfunction noFunction() {
  static char marker;
  return reinterpret_cast<CUfunction>(&marker);
}

}  // namespace detail

// A launch with programmatic dependent launch through the runtime's call, of a kernel chosen at
// run time (the probes; the library's launches take launchKernel<Kernel> below).
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

// Every kernel goes out with programmatic dependent launch: the next op's kernel is scheduled
// while the previous one drains (a graph node boundary 0.61 instead of 0.87 us on the H200, a
// probe of 200-node graphs; docs/decisions.md). It goes through the driver's cuLaunchKernelEx
// with the kernel's function handle in the device's primary context, looked up once: the
// runtime's cudaLaunchKernelEx looks the kernel up on every launch, 0.16-0.36 us more per launch
// on an H100 host (the launch-probe stage of scripts/device_run.sh). Should the driver's call
// fail (no handle, another context current), the runtime's call launches it and says why not.
template <auto Kernel, typename Args>
cudaError_t launchKernel(const Args& args, unsigned blocks, cudaStream_t stream,
                         unsigned threads = kThreads) {
  static std::atomic<CUfunction> handles[detail::kMaxDevices];
  const detail::DriverLaunchEx driver = detail::driverLaunchEx();
  int device = -1;
  if (driver != nullptr && cudaGetDevice(&device) == cudaSuccess && device >= 0 &&
      device < detail::kMaxDevices) {
    CUfunction f = handles[device].load(std::memory_order_acquire);
    if (f == nullptr) {
      // Looked up once per device: a failed lookup is remembered, and the runtime's call
      // launches from then on.
      cudaFunction_t h = nullptr;
      f = cudaGetFuncBySymbol(&h, reinterpret_cast<const void*>(Kernel)) == cudaSuccess &&
                  h != nullptr
              ? reinterpret_cast<CUfunction>(h)
              : detail::noFunction();
      handles[device].store(f, std::memory_order_release);
    }
    if (f != detail::noFunction()) {
      CUlaunchAttribute attr[1];
      attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attr[0].value.programmaticStreamSerializationAllowed = 1;
      CUlaunchConfig cfg = {};
      cfg.gridDimX = blocks;
      cfg.gridDimY = cfg.gridDimZ = 1;
      cfg.blockDimX = threads;
      cfg.blockDimY = cfg.blockDimZ = 1;
      cfg.hStream = stream;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      void* params[] = {const_cast<Args*>(&args)};
      if (driver(&cfg, f, params, nullptr) == CUDA_SUCCESS) return cudaSuccess;
    }
  }
  return launchKernel(Kernel, args, blocks, stream, threads);
}

}  // namespace gpu
}  // namespace resident
