// Host entry points of the kernels (compiled by nvcc; called from csrc/cuda). Torch-free.
// `pdl`: launch with programmatic dependent launch (RESIDENT_GPU_PDL).
#pragma once

#include <cuda_runtime.h>

#include "exchange_args.hpp"

namespace resident {
namespace gpu {

// How many blocks of the collective kernel (the heaviest) fit on one SM at once.
int residentBlocksPerSm();
cudaError_t launchCollective(const CollectiveArgs& args, unsigned blocks, cudaStream_t stream,
                             bool pdl);
cudaError_t launchSend(const P2PArgs& args, unsigned blocks, cudaStream_t stream, bool pdl);
cudaError_t launchRecv(const P2PArgs& args, unsigned blocks, cudaStream_t stream, bool pdl);

}  // namespace gpu
}  // namespace resident
