// Collectives whose every exchange is one part of one round (at most 2 KiB per peer, direct
// peers only): the decode-size case. One block, one thread per LL line, and after the wait for
// the previous kernel no barrier and no dispatch: each thread stores its line to every partner,
// polls its line from every partner and writes its output word. A kernel of its own per dtype,
// so that the path an op runs is a few hundred instructions. The H200 probe
// (scripts/ar8_probe.cu) put the general kernel (collective_body.cuh, whose per-dtype dispatch
// and rounds make it ~17k instructions) ~1 µs above a kernel of this shape for an 8 B
// all_reduce. The lines and slots are the general kernel's (same layout, same generations), so
// that ops of either kernel follow each other on a group.
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "launch_device.cuh"

namespace resident {
namespace gpu {
namespace {

// Stores this thread's line of the op to every partner (a credit line where it carries
// nothing), as sendRound does for round 0, part 0.
__device__ __forceinline__ void sendLines(const CollectiveArgs& a, const Shared& sh, uint32_t t) {
  const Region& reg = a.reg;
  // all_reduce and all_gather send every partner the same bytes: one load.
  uint64_t common = 0;
  const uint32_t common_nb = lineBytes(static_cast<uint32_t>(a.common_send_bytes), 0, t);
  if (a.common_send != nullptr && common_nb)
    common = loadBytes(static_cast<const unsigned char*>(a.common_send) + t * 8, common_nb);
  for (int p = 0; p < a.nranks; ++p) {
    const PeerPlan& pp = a.peers[p];
    if (p == a.rank || pp.rounds == 0) continue;
    const uint32_t sb = static_cast<uint32_t>(pp.send_bytes);
    if (t >= linesOf(sb, 0)) continue;
    const uint32_t g = sh.base[p] + 1;
    const uint64_t off =
        reg.coll_in0 + (static_cast<uint64_t>(a.rank) * 2 + ((g - 1) & 1)) * reg.slot_bytes;
    const uint32_t nb = lineBytes(sb, 0, t);
    uint64_t v = 0;
    if (a.common_send != nullptr)
      v = common;
    else if (nb)
      v = loadBytes(static_cast<const unsigned char*>(pp.send) + t * 8, nb);
    storeLine(sh.remote[p] + off + t * 16, v, g);
  }
}

template <typename Acc>
__global__ void __launch_bounds__(kThreads)
    singlePartReduce(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  enterCollective(a, sh);
  const uint32_t t = threadIdx.x;
  sendLines(a, sh, t);
  const uint32_t nb = lineBytes(static_cast<uint32_t>(a.peers[a.rank].recv_bytes), 0, t);
  if (nb == 0) return;
  const uint64_t mine = loadBytes(static_cast<const unsigned char*>(a.local_in) + t * 8, nb);
  Waiter w(a.reg, a.op_id);
  Acc acc;
  for (int q = 0; q < a.nranks; ++q) {  // in rank order: every rank rounds the same
    uint64_t v = mine;
    if (q != a.rank) {
      const uint32_t g = sh.base[q] + 1;
      if (!w.line(collSlotFrom(a.reg, q, g) + t * 16, g, v, q)) return;
    }
    if (q == 0)
      acc.first(v);
    else
      acc.fold(a.redop, v);
  }
  storeBytes(static_cast<unsigned char*>(a.out) + t * 8, acc.result(a.redop, a.nranks), nb);
}

__global__ void __launch_bounds__(kThreads)
    singlePartCopy(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  enterCollective(a, sh);
  const uint32_t t = threadIdx.x;
  sendLines(a, sh, t);
  const PeerPlan& self = a.peers[a.rank];
  if (self.rounds != 0 && self.recv != nullptr && self.send_bytes > 0) {
    const uint32_t nb = lineBytes(static_cast<uint32_t>(self.send_bytes), 0, t);
    if (nb)
      storeBytes(static_cast<unsigned char*>(self.recv) + t * 8,
                 loadBytes(static_cast<const unsigned char*>(self.send) + t * 8, nb), nb);
  }
  Waiter w(a.reg, a.op_id);
  for (int p = 0; p < a.nranks; ++p) {
    const PeerPlan& pp = a.peers[p];
    if (p == a.rank || pp.rounds == 0) continue;
    const uint32_t rb = static_cast<uint32_t>(pp.recv_bytes);
    if (t >= linesOf(rb, 0)) continue;  // a credit line is waited for too (slot reuse)
    const uint32_t g = sh.base[p] + 1;
    uint64_t v;
    if (!w.line(collSlotFrom(a.reg, p, g) + t * 16, g, v, p)) return;
    const uint32_t nb = lineBytes(rb, 0, t);
    if (nb) storeBytes(static_cast<unsigned char*>(pp.recv) + t * 8, v, nb);
  }
}

}  // namespace

cudaError_t launchSinglePart(const CollectiveArgs& args, unsigned threads, cudaStream_t stream,
                             bool pdl) {
  if (args.mode != static_cast<uint8_t>(Mode::kReduce))
    return launchKernel(singlePartCopy, args, 1, stream, pdl, threads);
  switch (args.dtype) {
    case kF32:
      return launchKernel(singlePartReduce<AccF32>, args, 1, stream, pdl, threads);
    case kF64:
      return launchKernel(singlePartReduce<AccF64>, args, 1, stream, pdl, threads);
    case kF16:
      return launchKernel(singlePartReduce<AccF16>, args, 1, stream, pdl, threads);
    case kBF16:
      return launchKernel(singlePartReduce<AccBF16>, args, 1, stream, pdl, threads);
    case kI32:
      return launchKernel(singlePartReduce<AccI32>, args, 1, stream, pdl, threads);
    case kI64:
      return launchKernel(singlePartReduce<AccI64>, args, 1, stream, pdl, threads);
    default:
      return launchKernel(singlePartReduce<AccU8>, args, 1, stream, pdl, threads);
  }
}

}  // namespace gpu
}  // namespace resident
