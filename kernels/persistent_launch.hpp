// Host entry points of the resident kernel (compiled by nvcc; called from csrc/cuda).
#pragma once

#include <cuda_runtime.h>

#include "persistent_args.hpp"

namespace resident {
namespace gpu {

// Launch of `blocks` blocks that stay resident until they leave (quit or idle).
cudaError_t launchPersistent(const PersistentArgs& args, unsigned blocks, cudaStream_t stream);
// How many blocks of the resident kernel fit on one SM at once.
int persistentBlocksPerSm();

}  // namespace gpu
}  // namespace resident
