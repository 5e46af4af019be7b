// Collectives that exchange one round with every partner, all of them direct peers (at most a
// chunk, 64 KiB by default, per peer and direction; one 2 KiB part per block): the decode sizes.
// Block j moves part j, one thread per LL line, and after the wait for the previous kernel it
// has no barrier and no dispatch: each thread stores its line into every partner's mapped
// region, polls its line from every partner and writes its output word. A kernel of its own per
// dtype, so that an op runs a few hundred instructions. On the H200 the general kernel
// (collective_body.cuh: rounds, proxy triggers, per-dtype dispatch, ~17k instructions) took ~1 µs
// more for an 8 B all_reduce (scripts/ar8_probe.cu, session 22). Ops with a proxied partner stay
// with the general kernel: versions of this one with proxy triggers (c93494c, b5882b6) were
// faster at 8 B but up to 1.6 µs slower from 64 B, for a reason not found (benchmarks/RESULTS.md,
// sessions 22 and 23). The lines and slots are the general kernel's round 0
// (same layout and generations), so that ops of either kernel follow each other on a group.
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "launch_device.cuh"

namespace resident {
namespace gpu {
namespace {

// Where thread t of block j works: its payload word's offset in the tensors, its line's offset
// in a slot (part j, line t).
struct LinePos {
  uint32_t j, t;
  uint64_t part_off, line_off;
  __device__ LinePos()
      : j(blockIdx.x),
        t(threadIdx.x),
        part_off(static_cast<uint64_t>(j) * kPartPayload + t * 8),
        line_off((static_cast<uint64_t>(j) * kThreads + t) * 16) {}
};

// Stores this thread's line of part j into every partner that exchanges part j (a credit line
// where it carries nothing), as sendRound does for round 0 with a direct peer.
__device__ __forceinline__ void sendPart(const CollectiveArgs& a, const Shared& sh,
                                         const LinePos& at) {
  const Region& reg = a.reg;
  const uint32_t j = at.j, t = at.t;
  const uint64_t part_off = at.part_off;
  // all_reduce and all_gather send every partner the same bytes: one load.
  uint64_t common = 0;
  const uint32_t common_nb = lineBytes(static_cast<uint32_t>(a.common_send_bytes), j, t);
  if (a.common_send != nullptr && common_nb)
    common = loadBytes(static_cast<const unsigned char*>(a.common_send) + part_off, common_nb);
  for (int p = 0; p < a.nranks; ++p) {
    const PeerPlan& pp = a.peers[p];
    if (p == a.rank || pp.rounds == 0 || j >= partnerParts(pp, 0, reg.chunk)) continue;
    const uint32_t sb = static_cast<uint32_t>(pp.send_bytes);
    if (t >= linesOf(sb, j)) continue;
    const uint32_t g = sh.base[p] + 1;
    const uint32_t nb = lineBytes(sb, j, t);
    uint64_t v = 0;
    if (a.common_send != nullptr)
      v = common;
    else if (nb)
      v = loadBytes(static_cast<const unsigned char*>(pp.send) + part_off, nb);
    storeLine(sh.remote[p] + collSlotOffset(reg, a.rank, (g - 1) & 1) + at.line_off, v, g);
  }
}

template <typename Acc>
__global__ void __launch_bounds__(kThreads)
    oneRoundReduce(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  enterCollective(a, sh);
  const LinePos at;
  sendPart(a, sh, at);
  const uint32_t nb = lineBytes(static_cast<uint32_t>(a.peers[a.rank].recv_bytes), at.j, at.t);
  if (nb == 0) return;
  Waiter w(a.reg, a.op_id);
  const uint64_t mine = loadBytes(static_cast<const unsigned char*>(a.local_in) + at.part_off, nb);
  Acc acc;
  for (int q = 0; q < a.nranks; ++q) {  // in rank order: every rank rounds the same
    uint64_t v = mine;
    if (q != a.rank) {
      const uint32_t g = sh.base[q] + 1;
      if (!w.line(collSlotFrom(a.reg, q, g) + at.line_off, g, v, q)) return;
    }
    if (q == 0)
      acc.first(v);
    else
      acc.fold(a.redop, v);
  }
  storeBytes(static_cast<unsigned char*>(a.out) + at.part_off, acc.result(a.redop, a.nranks), nb);
}

__global__ void __launch_bounds__(kThreads) oneRoundCopy(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  enterCollective(a, sh);
  const LinePos at;
  const uint32_t j = at.j, t = at.t;
  const uint64_t off = at.part_off;
  sendPart(a, sh, at);
  const PeerPlan& self = a.peers[a.rank];
  if (self.rounds != 0 && self.recv != nullptr && self.send_bytes > 0) {
    const uint32_t nb = lineBytes(static_cast<uint32_t>(self.send_bytes), j, t);
    if (nb)
      storeBytes(static_cast<unsigned char*>(self.recv) + off,
                 loadBytes(static_cast<const unsigned char*>(self.send) + off, nb), nb);
  }
  Waiter w(a.reg, a.op_id);
  for (int p = 0; p < a.nranks; ++p) {
    const PeerPlan& pp = a.peers[p];
    if (p == a.rank || pp.rounds == 0 || j >= partnerParts(pp, 0, a.reg.chunk)) continue;
    const uint32_t rb = static_cast<uint32_t>(pp.recv_bytes);
    if (t >= linesOf(rb, j)) continue;  // a credit line is waited for too (slot reuse)
    const uint32_t g = sh.base[p] + 1;
    uint64_t v;
    if (!w.line(collSlotFrom(a.reg, p, g) + at.line_off, g, v, p)) return;
    const uint32_t nb = lineBytes(rb, j, t);
    if (nb) storeBytes(static_cast<unsigned char*>(pp.recv) + off, v, nb);
  }
}

}  // namespace

cudaError_t launchOneRound(const CollectiveArgs& args, unsigned blocks, unsigned threads,
                           cudaStream_t stream, bool pdl) {
  if (args.mode != static_cast<uint8_t>(Mode::kReduce))
    return launchKernel(oneRoundCopy, args, blocks, stream, pdl, threads);
  return withAcc(args.dtype, [&](auto acc) {
    return launchKernel(oneRoundReduce<decltype(acc)>, args, blocks, stream, pdl, threads);
  });
}

}  // namespace gpu
}  // namespace resident
