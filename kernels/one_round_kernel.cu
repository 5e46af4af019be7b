// Collectives that exchange one round with every partner (at most a chunk, 64 KiB by default,
// per peer and direction; one 2 KiB part per block): the decode sizes. Block j moves part j,
// one thread per LL line, and after the wait for the previous kernel it has no barrier (but
// one before the proxy triggers of proxied partners) and no dispatch: each thread stores its
// line to every partner, polls its line from every partner and writes its output word. A kernel
// of its own per dtype, so that an op runs a few hundred instructions. On the H200 the general
// kernel (collective_body.cuh: rounds, per-dtype dispatch, ~17k instructions) took ~1 µs more
// for an 8 B all_reduce (scripts/ar8_probe.cu, session 22). The lines, slots and triggers are
// the general kernel's round 0 (same layout, generations and trigger ranges), so that ops of
// either kernel follow each other on a group.
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "launch_device.cuh"

namespace resident {
namespace gpu {
namespace {

// Proxied partners this block sends a part to (the same for every thread of the block).
__device__ __forceinline__ uint32_t proxiedPartners(const CollectiveArgs& a, uint32_t j) {
  uint32_t n = 0;
  for (int p = 0; p < a.nranks; ++p) {
    const PeerPlan& pp = a.peers[p];
    if (p != a.rank && pp.rounds != 0 && ((a.reg.proxied >> p) & 1) &&
        j < partnerParts(pp, 0, a.reg.chunk))
      ++n;
  }
  return n;
}

// Stores this thread's line of part j to every partner that exchanges part j (a credit line
// where it carries nothing), as sendRound does for round 0: into the partner's mapped region,
// or for a proxied partner into the outbox, then a trigger per proxied partner.
__device__ __forceinline__ void sendPart(const CollectiveArgs& a, Shared& sh, Waiter& w, uint32_t j,
                                         uint32_t t, uint32_t proxied) {
  const Region& reg = a.reg;
  const uint64_t part_off = static_cast<uint64_t>(j) * kPartPayload + t * 8;
  const uint64_t line_off = (static_cast<uint64_t>(j) * kThreads + t) * 16;
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
    const uint32_t slot = (g - 1) & 1;
    const uint32_t nb = lineBytes(sb, j, t);
    uint64_t v = 0;
    if (a.common_send != nullptr)
      v = common;
    else if (nb)
      v = loadBytes(static_cast<const unsigned char*>(pp.send) + part_off, nb);
    if (sh.remote[p] != nullptr) {
      const uint64_t remote_off =
          reg.coll_in0 + (static_cast<uint64_t>(a.rank) * 2 + slot) * reg.slot_bytes;
      storeLine(sh.remote[p] + remote_off + line_off, v, g);
    } else {
      const uint64_t local_off = static_cast<uint64_t>(p) * reg.out_stride + slot * reg.slot_bytes;
      storeLine(reg.outbox + local_off + line_off, v, g);
    }
  }
  if (proxied == 0) return;
  __syncthreads();  // every line of the block issued before the triggers (sh.fifo_pos too)
  if (t != 0) return;
  unsigned long long pos = sh.fifo_pos;
  for (int p = 0; p < a.nranks; ++p) {
    const PeerPlan& pp = a.peers[p];
    if (p == a.rank || pp.rounds == 0 || sh.remote[p] != nullptr ||
        j >= partnerParts(pp, 0, reg.chunk))
      continue;
    const uint32_t g = sh.base[p] + 1;
    const uint32_t slot = (g - 1) & 1;
    const uint64_t first = static_cast<uint64_t>(j) * kThreads * 16;
    const uint64_t local_off =
        static_cast<uint64_t>(p) * reg.out_stride + slot * reg.slot_bytes + first;
    const uint64_t remote_off =
        reg.coll_in0 + (static_cast<uint64_t>(a.rank) * 2 + slot) * reg.slot_bytes + first;
    const uint64_t bytes =
        static_cast<uint64_t>(linesOf(static_cast<uint32_t>(pp.send_bytes), j)) * 16;
    // A false return means the op gave up (Waiter::shouldStop raised `failed`): the block's
    // pollers see that and stop too.
    if (!pushTriggerAt(w, pos++, p, local_off, remote_off, bytes, TriggerKind::kLines, g)) return;
  }
}

// The op's start after the wait: trigger positions for the proxied partners (the atomic's
// round trip overlaps the line stores; read after sendPart's barrier).
__device__ __forceinline__ uint32_t beginPart(const CollectiveArgs& a, Shared& sh, uint32_t j) {
  const uint32_t proxied = a.reg.proxied != 0 ? proxiedPartners(a, j) : 0u;
  if (proxied != 0 && threadIdx.x == 0) sh.fifo_pos = reserveTriggers(a.reg, proxied);
  return proxied;
}

template <typename Acc>
__global__ void __launch_bounds__(kThreads)
    oneRoundReduce(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  enterCollective(a, sh);
  const uint32_t j = blockIdx.x, t = threadIdx.x;
  const uint32_t proxied = beginPart(a, sh, j);
  Waiter w(a.reg, a.op_id);
  sendPart(a, sh, w, j, t, proxied);
  const uint32_t nb = lineBytes(static_cast<uint32_t>(a.peers[a.rank].recv_bytes), j, t);
  if (nb == 0) return;
  const uint64_t off = static_cast<uint64_t>(j) * kPartPayload + t * 8;
  const uint64_t mine = loadBytes(static_cast<const unsigned char*>(a.local_in) + off, nb);
  Acc acc;
  for (int q = 0; q < a.nranks; ++q) {  // in rank order: every rank rounds the same
    uint64_t v = mine;
    if (q != a.rank) {
      const uint32_t g = sh.base[q] + 1;
      const uint64_t line_off = (static_cast<uint64_t>(j) * kThreads + t) * 16;
      if (!w.line(collSlotFrom(a.reg, q, g) + line_off, g, v, q)) return;
    }
    if (q == 0)
      acc.first(v);
    else
      acc.fold(a.redop, v);
  }
  storeBytes(static_cast<unsigned char*>(a.out) + off, acc.result(a.redop, a.nranks), nb);
}

__global__ void __launch_bounds__(kThreads) oneRoundCopy(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  enterCollective(a, sh);
  const uint32_t j = blockIdx.x, t = threadIdx.x;
  const uint32_t proxied = beginPart(a, sh, j);
  Waiter w(a.reg, a.op_id);
  sendPart(a, sh, w, j, t, proxied);
  const uint64_t off = static_cast<uint64_t>(j) * kPartPayload + t * 8;
  const PeerPlan& self = a.peers[a.rank];
  if (self.rounds != 0 && self.recv != nullptr && self.send_bytes > 0) {
    const uint32_t nb = lineBytes(static_cast<uint32_t>(self.send_bytes), j, t);
    if (nb)
      storeBytes(static_cast<unsigned char*>(self.recv) + off,
                 loadBytes(static_cast<const unsigned char*>(self.send) + off, nb), nb);
  }
  for (int p = 0; p < a.nranks; ++p) {
    const PeerPlan& pp = a.peers[p];
    if (p == a.rank || pp.rounds == 0 || j >= partnerParts(pp, 0, a.reg.chunk)) continue;
    const uint32_t rb = static_cast<uint32_t>(pp.recv_bytes);
    if (t >= linesOf(rb, j)) continue;  // a credit line is waited for too (slot reuse)
    const uint32_t g = sh.base[p] + 1;
    uint64_t v;
    const uint64_t line_off = (static_cast<uint64_t>(j) * kThreads + t) * 16;
    if (!w.line(collSlotFrom(a.reg, p, g) + line_off, g, v, p)) return;
    const uint32_t nb = lineBytes(rb, j, t);
    if (nb) storeBytes(static_cast<unsigned char*>(pp.recv) + off, v, nb);
  }
}

}  // namespace

cudaError_t launchOneRound(const CollectiveArgs& args, unsigned blocks, unsigned threads,
                           cudaStream_t stream, bool pdl) {
  if (args.mode != static_cast<uint8_t>(Mode::kReduce))
    return launchKernel(oneRoundCopy, args, blocks, stream, pdl, threads);
  switch (args.dtype) {
    case kF32:
      return launchKernel(oneRoundReduce<AccF32>, args, blocks, stream, pdl, threads);
    case kF64:
      return launchKernel(oneRoundReduce<AccF64>, args, blocks, stream, pdl, threads);
    case kF16:
      return launchKernel(oneRoundReduce<AccF16>, args, blocks, stream, pdl, threads);
    case kBF16:
      return launchKernel(oneRoundReduce<AccBF16>, args, blocks, stream, pdl, threads);
    case kI32:
      return launchKernel(oneRoundReduce<AccI32>, args, blocks, stream, pdl, threads);
    case kI64:
      return launchKernel(oneRoundReduce<AccI64>, args, blocks, stream, pdl, threads);
    default:
      return launchKernel(oneRoundReduce<AccU8>, args, blocks, stream, pdl, threads);
  }
}

}  // namespace gpu
}  // namespace resident
