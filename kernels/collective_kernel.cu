// One kernel per collective, on the caller's stream (the body is collective_body.cuh).
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "launch_device.cuh"

namespace resident {
namespace gpu {
namespace {

// Simple: built with the simple protocol (RESIDENT_GPU_PROTOCOL=simple, simple_device.cuh), a
// separate instantiation, so that the LL-only kernel keeps its registers (80 against 112 on
// sm_90: 3 blocks per SM instead of 2).
template <bool Simple>
__global__ void __launch_bounds__(kThreads)
    collectiveKernel(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  enterCollective(a, sh);
  stamp(a, sh, kStampWaited);
  collectiveBody<Simple>(a, sh);
  stamp(a, sh, kStampExit);
}

}  // namespace

int residentBlocksPerSm(bool simple) {
  int coll = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &coll, simple ? collectiveKernel<true> : collectiveKernel<false>, kThreads, 0);
  return coll;
}

cudaError_t loadCollectiveKernels() {
  return loadFunctions({reinterpret_cast<const void*>(collectiveKernel<false>),
                        reinterpret_cast<const void*>(collectiveKernel<true>)});
}

cudaError_t launchCollective(const CollectiveArgs& args, unsigned blocks, cudaStream_t stream) {
  if (args.reg.simple != 0) return launchKernel<collectiveKernel<true>>(args, blocks, stream);
  return launchKernel<collectiveKernel<false>>(args, blocks, stream);
}

}  // namespace gpu
}  // namespace resident
