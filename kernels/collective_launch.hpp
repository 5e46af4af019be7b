// Host entry points of the kernels (compiled by nvcc; called from csrc/cuda). Torch-free.
#pragma once

#include <cuda_runtime.h>

#include "exchange_args.hpp"

namespace resident {
namespace gpu {

cudaError_t launchCollective(const CollectiveArgs& args, unsigned blocks, cudaStream_t stream);
cudaError_t launchSend(const P2PArgs& args, unsigned blocks, cudaStream_t stream);
cudaError_t launchRecv(const P2PArgs& args, unsigned blocks, cudaStream_t stream);

}  // namespace gpu
}  // namespace resident
