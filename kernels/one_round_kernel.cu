// Collectives that exchange one round with every partner (at most a chunk, 64 KiB by default,
// per peer and direction; one 2 KiB part per block): the decode sizes. Block j moves part j,
// one thread per LL line: each thread stores its line to every partner (into a direct peer's
// mapped region, or into the outbox for a proxied one), polls its line from every partner and
// writes its output word. A kernel of its own per dtype.
//
// Why it is built this way: a GPU thread runs its instructions one after another, a few
// nanoseconds each, so every instruction between the wait for the previous kernel and the
// line's store (and between the peer's line and the kernel's end) is latency the op pays.
// Everything that depends only on the arguments and the round state is therefore resolved
// before that wait, while the previous kernel still runs (programmatic dependent launch): the
// block's partners in rank order with their addresses, byte counts and generations (Plan), and
// the proxied partners' trigger words. After the wait a thread reads its plan from shared
// memory, loads its word, stores its lines, hands the triggers to the proxy and polls. On the
// H200 the general kernel (collective_body.cuh: rounds, per-dtype dispatch, ~17k instructions)
// took ~1 µs more for an 8 B all_reduce on the direct path (scripts/ar8_probe.cu) and 1-2 µs
// more on the proxy path (scripts/proxy8_probe.cu; sessions 22-24 in benchmarks/RESULTS.md).
// The lines, slots and trigger ranges are the general kernel's round 0 (same layout and
// generations), so that ops of either kernel follow each other on a group.
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "launch_device.cuh"

namespace resident {
namespace gpu {
namespace {

// Payload bytes of part j of the first round of a message of `total` bytes (0 .. 2 KiB).
__device__ __forceinline__ uint32_t partBytes(uint64_t total, uint32_t chunk, uint32_t j) {
  const int64_t len = partLen(roundBytes(total, 0, chunk), j);
  if (len <= 0) return 0u;
  return static_cast<uint32_t>(len < kPartPayload ? len : kPartPayload);
}

// Bytes line t of a part of `part_bytes` carries (0: past the payload, or a credit line).
__device__ __forceinline__ uint32_t bytesOfLine(uint32_t part_bytes, uint32_t t) {
  const int32_t len = static_cast<int32_t>(part_bytes) - static_cast<int32_t>(t * 8);
  if (len <= 0) return 0u;
  return len < 8 ? static_cast<uint32_t>(len) : 8u;
}

// Lines of a part: its payload lines, or one credit line when it carries nothing.
__device__ __forceinline__ uint32_t linesOfPart(uint32_t part_bytes) {
  return part_bytes ? (part_bytes + 7) / 8 : 1u;
}

// A partner of this block in the op: where the block's lines to it go (the partner's slot when
// direct, the outbox when proxied), where its lines for the block arrive, and what the block's
// part carries each way.
struct Route {
  unsigned char* to;          // line 0 of the block's part
  const unsigned char* from;  // line 0 of the partner's part, in this rank's region
  const unsigned char* send;  // the part's bytes for the partner; null: Plan::common or none
  unsigned char* recv;        // copy mode: where the partner's bytes of the part go
  uint32_t g;                 // the round's generation, both ways
  uint32_t send_bytes, recv_bytes;
  int peer;
};

// What the block does after the wait for the previous kernel, resolved before it.
struct Plan {
  Route route[kMaxRanks - 1];           // partners, in rank order
  TriggerWords trigger[kMaxRanks - 1];  // thread 0's pushes, one per proxied partner
  const unsigned char* common;          // the part every partner is sent, or null
  const unsigned char* self_send;       // reduce: this rank's input; copy: its own part's source
  unsigned char* self_recv;             // reduce: the output; copy: own part's target, or null
  uint32_t common_bytes, self_bytes;
  uint32_t n;           // routes
  uint32_t below;       // routes to lower ranks: where this rank's own bytes fold in (reduce)
  uint32_t triggers;    // proxied routes
  bool mine_is_common;  // reduce: this rank's input is the common part (all_reduce)
};

// Warp 0 (32 ranks per pass): the round state of every rank into `sh` (for advanceRounds), and
// the block's partners, compacted in rank order, into the plan; lane 0 the rest of the plan.
__device__ inline void planBlock(const CollectiveArgs& a, Shared& sh, Plan& plan) {
  const Region& reg = a.reg;
  const uint32_t j = blockIdx.x, lane = threadIdx.x;
  const uint64_t first_line = static_cast<uint64_t>(j) * kThreads * 16;
  const uint64_t part_off = static_cast<uint64_t>(j) * kPartPayload;
  const unsigned lower = (1u << lane) - 1u;
  uint32_t n = 0, below = 0, triggers = 0;
  for (int p0 = 0; p0 < a.nranks; p0 += 32) {
    const int p = p0 + static_cast<int>(lane);
    bool partner = false, proxied = false;
    if (p < a.nranks) {
      const uint32_t base =
          *reinterpret_cast<volatile uint32_t*>(&reg.state->coll_round[p]);  // not from L1
      unsigned char* remote = reg.state->remote[p];
      sh.base[p] = base;
      sh.remote[p] = remote;
      const PeerPlan& pp = a.peers[p];
      partner = p != a.rank && pp.rounds != 0 && j < partnerParts(pp, 0, reg.chunk);
      proxied = partner && ((reg.proxied >> p) & 1);
    }
    const unsigned partners = __ballot_sync(~0u, partner);
    const unsigned proxied_set = __ballot_sync(~0u, proxied);
    if (partner) {
      const PeerPlan& pp = a.peers[p];
      const uint32_t g = sh.base[p] + 1;
      const uint32_t slot = (g - 1) & 1;
      const uint64_t out_off =
          static_cast<uint64_t>(p) * reg.out_stride + slot * reg.slot_bytes + first_line;
      const uint64_t in_off = collSlotOffset(reg, a.rank, slot) + first_line;
      Route& r = plan.route[n + __popc(partners & lower)];
      r.to = sh.remote[p] != nullptr ? sh.remote[p] + in_off : reg.outbox + out_off;
      r.from = collSlotFrom(reg, p, g) + first_line;
      r.send = a.common_send == nullptr && pp.send != nullptr
                   ? static_cast<const unsigned char*>(pp.send) + part_off
                   : nullptr;
      r.recv = pp.recv != nullptr ? static_cast<unsigned char*>(pp.recv) + part_off : nullptr;
      r.g = g;
      r.send_bytes = partBytes(pp.send_bytes, reg.chunk, j);
      r.recv_bytes = partBytes(pp.recv_bytes, reg.chunk, j);
      r.peer = p;
      if (proxied)
        plan.trigger[triggers + __popc(proxied_set & lower)] = triggerWords(
            reg, p, out_off, in_off, linesOfPart(r.send_bytes) * 16ull, TriggerKind::kLines, g);
    }
    const int ranks_below = a.rank - p0;  // of this pass's 32
    below += __popc(partners & (ranks_below >= 32  ? ~0u
                                : ranks_below <= 0 ? 0u
                                                   : (1u << ranks_below) - 1u));
    n += __popc(partners);
    triggers += __popc(proxied_set);
  }
  if (lane != 0) return;
  plan.n = n;
  plan.below = below;
  plan.triggers = triggers;
  const PeerPlan& self = a.peers[a.rank];
  plan.common = a.common_send != nullptr
                    ? static_cast<const unsigned char*>(a.common_send) + part_off
                    : nullptr;
  plan.common_bytes = partBytes(a.common_send_bytes, reg.chunk, j);
  if (a.mode == static_cast<uint8_t>(Mode::kReduce)) {
    plan.self_send = static_cast<const unsigned char*>(a.local_in) + part_off;
    plan.self_recv = static_cast<unsigned char*>(a.out) + part_off;
    plan.self_bytes = partBytes(self.recv_bytes, reg.chunk, j);
    plan.mine_is_common = a.common_send == a.local_in && plan.common_bytes == plan.self_bytes;
  } else {
    const bool copies = self.rounds != 0 && self.recv != nullptr && self.send_bytes > 0;
    plan.self_send = copies ? static_cast<const unsigned char*>(self.send) + part_off : nullptr;
    plan.self_recv = copies ? static_cast<unsigned char*>(self.recv) + part_off : nullptr;
    plan.self_bytes = copies ? partBytes(self.send_bytes, reg.chunk, j) : 0u;
    plan.mine_is_common = false;
  }
}

// The op's start: the plan and the round state (warp 0), the advance of the round numbers by
// the last block to have read them, then the wait for the previous kernel (pdlEnter), as
// enterCollective does for the general kernel.
__device__ __forceinline__ void enterOneRound(const CollectiveArgs& a, Shared& sh, Plan& plan) {
  if (threadIdx.x < 32) planBlock(a, sh, plan);
  __syncthreads();
  if (threadIdx.x == 0 && lastBlockOf(&a.reg.state->coll_blocks_done)) {
    advanceRounds(a, sh);
    __threadfence();
  }
  __syncthreads();
  pdlEnter();
}

// The block's trigger positions, taken by thread 0 first thing after the wait together with
// the FIFO tail it checks them against: both round trips overlap the payload load.
struct TriggerSpan {
  unsigned long long pos = 0, tail_seen = 0;
  __device__ TriggerSpan(const Region& reg, uint32_t triggers) {
    if (triggers == 0 || threadIdx.x != 0) return;
    pos = reserveTriggers(reg, triggers);
    tail_seen = loadTailCache(reg);
  }
};

// The op's sending half, shared by both kernels so that they follow one protocol
// (block-uniform): after the wait the trigger positions first thing, this thread's line to
// every partner, and the prepared triggers, which the proxy posts once the lines' flags show.
// Should a push give up (the op was aborted or timed out: Waiter::shouldStop raised `failed`),
// the block's pollers see that and stop. `common`: this thread's word of Plan::common. Returns
// the op's Waiter.
__device__ __forceinline__ Waiter sendOneRound(const CollectiveArgs& a, const Plan& plan,
                                               uint32_t t, uint64_t& common) {
  const TriggerSpan span(a.reg, plan.triggers);
  Waiter w(a.reg, a.op_id);
  const uint32_t common_nb = plan.common != nullptr ? bytesOfLine(plan.common_bytes, t) : 0u;
  common = common_nb ? loadBytes(plan.common + t * 8, common_nb) : 0;
  for (uint32_t i = 0; i < plan.n; ++i) {
    const Route& r = plan.route[i];
    if (t >= linesOfPart(r.send_bytes)) continue;
    uint64_t v = common;
    const uint32_t nb = r.send != nullptr ? bytesOfLine(r.send_bytes, t) : 0u;
    if (nb) v = loadBytes(r.send + t * 8, nb);
    storeLine(r.to + t * 16, v, r.g);
  }
  if (plan.triggers != 0) {
    pushFromThread0([&] {
      for (uint32_t i = 0; i < plan.triggers; ++i)
        if (!pushTriggerWords(w, span.pos + i, span.tail_seen, plan.trigger[i])) break;
    });
  }
  return w;
}

template <typename Acc>
__global__ void __launch_bounds__(kThreads)
    oneRoundReduce(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  __shared__ Plan plan;
  const uint32_t t = threadIdx.x;
  enterOneRound(a, sh, plan);
  const uint32_t nb = bytesOfLine(plan.self_bytes, t);
  const uint64_t own = nb && !plan.mine_is_common ? loadBytes(plan.self_send + t * 8, nb) : 0;
  uint64_t common;
  Waiter w = sendOneRound(a, plan, t, common);
  if (nb == 0) return;
  const uint64_t mine = plan.mine_is_common ? common : own;
  Acc acc;
  // In rank order, this rank's own bytes in their place: every rank rounds the same.
  for (uint32_t k = 0; k <= plan.n; ++k) {
    uint64_t v = mine;
    if (k != plan.below) {
      const Route& r = plan.route[k < plan.below ? k : k - 1];
      if (!w.line(r.from + t * 16, r.g, v, r.peer)) return;
    }
    if (k == 0)
      acc.first(v);
    else
      acc.fold(a.redop, v);
  }
  storeBytes(plan.self_recv + t * 8, acc.result(a.redop, a.nranks), nb);
}

__global__ void __launch_bounds__(kThreads) oneRoundCopy(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  __shared__ Plan plan;
  const uint32_t t = threadIdx.x;
  enterOneRound(a, sh, plan);
  uint64_t common;
  Waiter w = sendOneRound(a, plan, t, common);
  const uint32_t own_nb = plan.self_recv != nullptr ? bytesOfLine(plan.self_bytes, t) : 0u;
  if (own_nb) storeBytes(plan.self_recv + t * 8, loadBytes(plan.self_send + t * 8, own_nb), own_nb);
  for (uint32_t i = 0; i < plan.n; ++i) {
    const Route& r = plan.route[i];
    if (t >= linesOfPart(r.recv_bytes)) continue;  // a credit line is waited for too (slot reuse)
    uint64_t v;
    if (!w.line(r.from + t * 16, r.g, v, r.peer)) return;
    const uint32_t nb = bytesOfLine(r.recv_bytes, t);
    if (nb) storeBytes(r.recv + t * 8, v, nb);
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
