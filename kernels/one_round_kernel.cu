// Collectives that exchange one round with every partner (at most a chunk, 64 KiB by default,
// per peer and direction; one 2 KiB part per block): the decode sizes. Block j moves part j,
// one thread per LL line, and after the wait for the previous kernel it has no dispatch and no
// barrier but the one before the triggers of proxied partners: each thread stores its line to
// every partner (into a direct peer's mapped region, or into the outbox for a proxied one),
// polls its line from every partner and writes its output word. A kernel of its own per dtype,
// so that an op does little after the wait; what only depends on the arguments (the proxied
// partners' trigger words) is prepared before it. On the H200 the general kernel
// (collective_body.cuh: rounds, per-dtype dispatch, ~17k instructions) took ~1 µs more for an
// 8 B all_reduce on the direct path (scripts/ar8_probe.cu) and 1-2 µs more on the proxy path,
// where the least kernel of the design met the target (scripts/proxy8_probe.cu; sessions 22
// and 23 in benchmarks/RESULTS.md). The lines, slots and trigger ranges are the general kernel's
// round 0 (same layout and generations), so that ops of either kernel follow each other on a
// group.
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
// where it carries nothing), as sendRound does for round 0: into a direct peer's mapped region,
// or into the outbox for a proxied one.
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
    const uint32_t slot = (g - 1) & 1;
    unsigned char* line =
        sh.remote[p] != nullptr
            ? sh.remote[p] + collSlotOffset(reg, a.rank, slot)
            : reg.outbox + static_cast<uint64_t>(p) * reg.out_stride + slot * reg.slot_bytes;
    storeLine(line + at.line_off, v, g);
  }
}

// Whether block j sends partner p a part through the proxy (the same for every thread).
__device__ __forceinline__ bool proxiedPartner(const CollectiveArgs& a, int p, uint32_t j) {
  const PeerPlan& pp = a.peers[p];
  return p != a.rank && ((a.reg.proxied >> p) & 1) && pp.rounds != 0 &&
         j < partnerParts(pp, 0, a.reg.chunk);
}

// Proxied partners that block j sends a part to.
__device__ __forceinline__ uint32_t proxiedPartners(const CollectiveArgs& a, uint32_t j) {
  uint32_t n = 0;
  if (a.reg.proxied == 0) return n;
  for (int p = 0; p < a.nranks; ++p) n += proxiedPartner(a, p, j) ? 1u : 0u;
  return n;
}

// Thread 0, before the wait: the words of the block's trigger to each proxied partner (its part
// of round 0's lines, as sendRound's), so that after the wait a push is a store or two.
__device__ inline void prepareTriggers(const CollectiveArgs& a, const Shared& sh, const LinePos& at,
                                       TriggerWords* out) {
  if (at.t != 0) return;
  const Region& reg = a.reg;
  const uint64_t first = static_cast<uint64_t>(at.j) * kThreads * 16;
  uint32_t n = 0;
  for (int p = 0; p < a.nranks; ++p) {
    if (!proxiedPartner(a, p, at.j)) continue;
    const uint32_t g = sh.base[p] + 1;
    const uint32_t slot = (g - 1) & 1;
    const uint64_t local_off =
        static_cast<uint64_t>(p) * reg.out_stride + slot * reg.slot_bytes + first;
    const uint64_t remote_off = collSlotOffset(reg, a.rank, slot) + first;
    const uint64_t bytes =
        static_cast<uint64_t>(linesOf(static_cast<uint32_t>(a.peers[p].send_bytes), at.j)) * 16;
    out[n++] = triggerWords(reg, p, local_off, remote_off, bytes, TriggerKind::kLines, g);
  }
}

// The block's trigger positions, taken by thread 0 first thing after the wait together with
// the FIFO tail it checks them against: both round trips overlap the payload load.
struct TriggerSpan {
  unsigned long long pos = 0, tail_seen = 0;
  __device__ TriggerSpan(const CollectiveArgs& a, uint32_t proxied) {
    if (proxied == 0 || threadIdx.x != 0) return;
    pos = reserveTriggers(a.reg, proxied);
    tail_seen = loadTailCache(a.reg);
  }
};

// The op's sending half, shared by both kernels so that they follow one protocol (block-uniform):
// the round state and, before the wait for the previous kernel, the proxied partners' trigger
// words (their reads of the arguments also warm the constant cache for the stores after it);
// after it the trigger positions first thing, this thread's line to every partner, and the
// prepared triggers, which the proxy posts once the lines' flags show. Should a push give up
// (the op was aborted or timed out: Waiter::shouldStop raised `failed`), the block's pollers see
// that and stop. Returns the op's Waiter.
__device__ __forceinline__ Waiter sendOneRound(const CollectiveArgs& a, Shared& sh,
                                               TriggerWords* triggers, const LinePos& at) {
  enterRounds(a, sh);
  const uint32_t proxied = proxiedPartners(a, at.j);
  if (proxied != 0) prepareTriggers(a, sh, at, triggers);
  pdlEnter();
  const TriggerSpan span(a, proxied);
  Waiter w(a.reg, a.op_id);
  sendPart(a, sh, at);
  if (proxied != 0) {
    pushFromThread0([&] {
      for (uint32_t i = 0; i < proxied; ++i)
        if (!pushTriggerWords(w, span.pos + i, span.tail_seen, triggers[i])) break;
    });
  }
  return w;
}

template <typename Acc>
__global__ void __launch_bounds__(kThreads)
    oneRoundReduce(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  __shared__ TriggerWords triggers[kMaxRanks];
  const LinePos at;
  Waiter w = sendOneRound(a, sh, triggers, at);
  const uint32_t nb = lineBytes(static_cast<uint32_t>(a.peers[a.rank].recv_bytes), at.j, at.t);
  if (nb == 0) return;
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
  __shared__ TriggerWords triggers[kMaxRanks];
  const LinePos at;
  const uint32_t j = at.j, t = at.t;
  const uint64_t off = at.part_off;
  Waiter w = sendOneRound(a, sh, triggers, at);
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
