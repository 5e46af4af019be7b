// all_to_all with per-peer row counts read on the device (SplitsArgs): the collective body
// (collective_body.cuh) on a plan built in shared memory from the counts at kernel start.
// A separate kernel, so that the ordinary collective kernel keeps reading its plan from the
// grid constants with its registers and timing unchanged.
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "launch_device.cuh"

namespace resident {
namespace gpu {
namespace {

static_assert(sizeof(CollectiveArgs) % 8 == 0, "CollectiveArgs is copied in 8-byte words");

// Rows of each peer from the counts arrays, summed over the `per_peer` entries of each peer
// (negative entries count as 0) by every thread of the block at once, then clamped to
// [0, max_rows] (a count past the capacity would run off the buffers; both sides of a pair clamp
// the same sum alike). `sums` ([2][kMaxRanks], shared) ends with the send and recv rows.
__device__ __forceinline__ void sumRows(const SplitsArgs& s, int nranks, unsigned long long* sums) {
  for (int i = threadIdx.x; i < 2 * kMaxRanks; i += blockDim.x) sums[i] = 0;
  __syncthreads();
  const int n = nranks * static_cast<int>(s.per_peer);
  for (int i = threadIdx.x; i < 2 * n; i += blockDim.x) {
    const bool send = i < n;
    const void* counts = send ? s.send_rows : s.recv_rows;
    const int j = send ? i : i - n;
    const int64_t v = s.count_bytes == 8 ? static_cast<const int64_t*>(counts)[j]
                                         : static_cast<const int32_t*>(counts)[j];
    if (v > 0)
      atomicAdd(&sums[(send ? 0 : kMaxRanks) + j / static_cast<int>(s.per_peer)],
                static_cast<unsigned long long>(v));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * kMaxRanks; i += blockDim.x)
    sums[i] = sums[i] < s.max_rows ? sums[i] : s.max_rows;
  __syncthreads();
}

template <bool Simple>
__global__ void __launch_bounds__(kThreads) splitsKernel(const __grid_constant__ SplitsArgs s) {
  __shared__ Shared sh;
  __shared__ CollectiveArgs a;
  {
    const auto* from = reinterpret_cast<const uint64_t*>(&s.coll);
    auto* to = reinterpret_cast<uint64_t*>(&a);
    for (uint32_t i = threadIdx.x; i < sizeof(CollectiveArgs) / 8; i += blockDim.x) to[i] = from[i];
  }
  loadRoundState(s.coll, sh);
  // The counts are written by the stream's previous kernels (the counts exchange): wait for
  // them before reading. The round advance below needs the rounds they give.
  pdlWait();
  __syncthreads();                                    // the copy of the args is complete
  __shared__ unsigned long long rows[2 * kMaxRanks];  // send, then recv rows per peer
  sumRows(s, a.nranks, rows);
  const uint32_t chunk = a.reg.chunk;
  for (int p = threadIdx.x; p < a.nranks; p += blockDim.x) {
    PeerPlan& pp = a.peers[p];
    const uint64_t send = rows[p] * s.row_bytes;
    // This rank's own rows: what it sends itself is what it receives from itself.
    const uint64_t recv = p == a.rank ? send : rows[kMaxRanks + p] * s.row_bytes;
    pp.send_bytes = send;
    pp.recv_bytes = recv;
    pp.rounds = static_cast<uint32_t>(roundsOfBytes(send > recv ? send : recv, chunk));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t rounds_max = 0;
    uint64_t first_max = 0;
    for (int p = 0; p < a.nranks; ++p) {
      const PeerPlan& pp = a.peers[p];
      rounds_max = pp.rounds > rounds_max ? pp.rounds : rounds_max;
      const uint64_t b = pp.send_bytes > pp.recv_bytes ? pp.send_bytes : pp.recv_bytes;
      const uint64_t first = b < chunk ? b : chunk;
      first_max = first > first_max ? first : first_max;
    }
    a.rounds_max = rounds_max;
    // As GpuCommunicator::fenceTriggers decides from the host's byte counts.
    a.reg.trigger_fence = first_max >= s.fence_from_bytes ? 1u : 0u;
  }
  advanceOnceLoaded(a, sh);  // begins with a barrier: the plan above is visible
  // The next kernel launches when this one's blocks exit, as after a collective of several
  // rounds (enterCollective).
  collectiveBody<Simple>(a, sh);
}

}  // namespace

int splitsBlocksPerSm(bool simple) {
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n, simple ? splitsKernel<true> : splitsKernel<false>, kThreads, 0);
  return n;
}

cudaError_t launchSplits(const SplitsArgs& args, unsigned blocks, cudaStream_t stream) {
  if (args.coll.reg.simple != 0) return launchKernel(splitsKernel<true>, args, blocks, stream);
  return launchKernel(splitsKernel<false>, args, blocks, stream);
}

}  // namespace gpu
}  // namespace resident
