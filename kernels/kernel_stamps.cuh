// The general collective kernel's timeline for RESIDENT_GPU_PROXY_TRACE (Region::stamps,
// exchange_args.hpp): thread 0 of the op's first and last block stores %globaltimer at each
// StampPoint, so that a trace can split the GPU's part of an op (stores and hand-off, the wait
// for partners, the read and reduction, the kernel boundary) from the proxy's, which the host
// trace times. Off (a null pointer): one predicated branch per point.
#pragma once

#include <cstdint>

#include "exchange_args.hpp"
#include "ll_device.cuh"

namespace resident {
namespace gpu {

// `op()`: the op's round number with the next rank (the same in every block of the op), asked
// for only when the timeline is on.
template <typename Op>
__device__ __forceinline__ void stampAt(const Region& reg, Op&& op, StampPoint point) {
  if (reg.stamps == nullptr || threadIdx.x != 0) return;
  const uint32_t which = blockIdx.x == 0 ? 0u : (blockIdx.x + 1 == gridDim.x ? 1u : 2u);
  if (which > 1) return;
  reg.stamps[((op() % kStampOps) * 2 + which) * kStampsPerBlock + point] = globalTimerNs();
}

}  // namespace gpu
}  // namespace resident
