// One kernel per collective, on the caller's stream (the body is collective_body.cuh).
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "launch_device.cuh"

namespace resident {
namespace gpu {
namespace {

__global__ void __launch_bounds__(kThreads)
    collectiveKernel(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  pdlEnter();
  collectiveBody(a, sh, blockIdx.x);
  // The last block to finish advances the round numbers for the next op (a single block
  // needs no counter: the kernel boundary publishes its stores).
  if (threadIdx.x == 0 && lastBlockOf(&a.reg.state->coll_blocks_done)) advanceRounds(a, sh);
}

}  // namespace

int residentBlocksPerSm() {
  int coll = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&coll, collectiveKernel, kThreads, 0);
  return coll;
}

cudaError_t launchCollective(const CollectiveArgs& args, unsigned blocks, cudaStream_t stream,
                             bool pdl) {
  return launchKernel(collectiveKernel, args, blocks, stream, pdl);
}

}  // namespace gpu
}  // namespace resident
