// Host entry points of the kernels (compiled by nvcc; called from csrc/cuda). Torch-free.
// Every kernel is launched with programmatic dependent launch (launch_device.cuh).
#pragma once

#include <cuda_runtime.h>

#include "exchange_args.hpp"

namespace resident {
namespace gpu {

// How many blocks of the collective kernel (the heaviest) fit on one SM at once; `simple`:
// its build with the simple protocol (Region::simple), which launchCollective picks by the
// args' Region::simple.
int residentBlocksPerSm(bool simple);
cudaError_t launchCollective(const CollectiveArgs& args, unsigned blocks, cudaStream_t stream);
// The all_to_all with counts read on the device (splits_kernel.cu; SplitsArgs), and how many of
// its blocks fit on one SM at once (its plan lives in shared memory).
cudaError_t launchSplits(const SplitsArgs& args, unsigned blocks, cudaStream_t stream);
int splitsBlocksPerSm(bool simple);
// An op of one round with every partner (one_round_kernel.cu): a block per 2 KiB part of the
// largest exchange, `threads` per block (a multiple of 32, at most kThreads: one per LL line).
cudaError_t launchOneRound(const CollectiveArgs& args, unsigned blocks, unsigned threads,
                           cudaStream_t stream);
// Each loads its file's kernels now, every instantiation. Under lazy module loading (CUDA's
// default) a kernel is loaded at its first launch, which may wait for the context's running
// kernels: a recv spinning for a peer whose matching send (or whose next op, as the first
// reduction of a dtype or the first EP kernel) is stuck in such a load would never finish.
cudaError_t loadCollectiveKernels();
cudaError_t loadSplitsKernels();
cudaError_t loadOneRoundKernels();
cudaError_t loadP2PKernels();
cudaError_t launchSend(const P2PArgs& args, unsigned blocks, cudaStream_t stream);
cudaError_t launchRecv(const P2PArgs& args, unsigned blocks, cudaStream_t stream);

}  // namespace gpu
}  // namespace resident
