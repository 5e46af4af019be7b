// Host entry points of the resident kernel (compiled by nvcc; called from csrc/cuda).
#pragma once

#include <cuda_runtime.h>

#include "persistent_args.hpp"

namespace resident {
namespace gpu {

// Launch of `blocks` blocks that stay resident until they leave (quit or idle); `simple`: the
// build with the simple protocol (the group's Region::simple, which its descriptors carry).
cudaError_t launchPersistent(const PersistentArgs& args, unsigned blocks, cudaStream_t stream,
                             bool simple);
// How many blocks of the resident kernel (of that build) fit on one SM at once.
int persistentBlocksPerSm(bool simple);

}  // namespace gpu
}  // namespace resident
