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
// the proxied partners' trigger words. After the wait a thread works from registers (its words,
// its lines to and from the first partner: a block's only one at 2 ranks) and, for further
// partners, from the plan in shared memory: it loads its word, stores its lines, hands the
// triggers to the proxy and polls. On the H200 the proxied 8 B all_reduce takes ~3.4 µs this
// way, against ~4.0 µs with 840 instruction slots between the wait and the line store (162
// here). The general kernel (collective_body.cuh: rounds, per-dtype dispatch, ~17k
// instructions) takes ~1 µs more at 8 B on both paths (benchmarks/probes/ar8_probe.cu and
// proxy8_probe.cu: `bash scripts/device_run.sh ar8-probe proxy8-probe`).
// The lines, slots and trigger ranges are the general kernel's round 0 (same layout and
// generations), so that ops of either kernel follow each other on a group.
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "fifo_device.cuh"
#include "launch_device.cuh"

namespace resident {
namespace gpu {
namespace {

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

// A partner exchanging the op with the simple protocol (simplePair; direct, the host
// launches this kernel for no proxied one): the slots its flag for this block's part goes to and
// comes from (Route::to and ::from then address the part's payload words). Null: LL lines.
struct SimpleRoute {
  unsigned char* to_slot;
  const unsigned char* from_slot;
};

// LL lines of a part from a partner that a block's threads wait for, one each (threads from
// 0 up): its lines carrying `recv_bytes`, or none from a simple pair (the block waits for its
// flag instead). Both the plan's block-wide count and each thread's lane take it from here.
__device__ __forceinline__ uint32_t waitedLines(bool simple, uint32_t recv_bytes) {
  return simple ? 0u : linesOfPart(recv_bytes);
}

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
  uint32_t wait_lines;  // LL lines of the part from its largest partner: threads below wait
  bool mine_is_common;  // reduce: this rank's input is the common part (all_reduce)
  SimpleRoute simple[kMaxRanks - 1];  // per route; written by the kernel built with Simple only
};

// Warp 0 (32 ranks per pass): the round state of every rank into `sh` (for advanceRounds), and
// the block's partners, compacted in rank order, into the plan; lane 0 the rest of the plan.
// Simple: routes of simple pairs address the slots' payload words (simpleWordOffset) and flags.
template <bool Simple>
__device__ inline void planBlock(const CollectiveArgs& a, Shared& sh, Plan& plan) {
  const Region& reg = a.reg;
  const uint32_t j = blockIdx.x, lane = threadIdx.x;
  const uint64_t first_line = static_cast<uint64_t>(j) * kThreads * 16;
  const uint64_t part_off = static_cast<uint64_t>(j) * kPartPayload;
  const unsigned lower = (1u << lane) - 1u;
  uint32_t n = 0, below = 0, triggers = 0, wait_lines = 0;
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
      const uint64_t out_off = outCollOffset(reg, p, slot) + first_line;
      const uint64_t in_slot = collInOffset(reg, a.rank, slot);
      const uint64_t in_off = in_slot + first_line;
      const uint32_t idx = n + __popc(partners & lower);
      Route& r = plan.route[idx];
      r.to = sh.remote[p] != nullptr ? sh.remote[p] + in_off : reg.outbox + out_off;
      r.from = collSlotFrom(reg, p, g) + first_line;
      if constexpr (Simple) {
        SimpleRoute& sr = plan.simple[idx];
        sr = SimpleRoute{nullptr, nullptr};
        if (simplePair(reg, p, pairRoundBytes(pp, 0, reg.chunk))) {
          sr.to_slot = sh.remote[p] + in_slot;
          sr.from_slot = collSlotFrom(reg, p, g);
          r.to = sr.to_slot + simpleWordOffset(reg, j, 0);
          r.from = sr.from_slot + simpleWordOffset(reg, j, 0);
        }
      }
      r.send = a.common_send == nullptr && pp.send != nullptr
                   ? static_cast<const unsigned char*>(pp.send) + part_off
                   : nullptr;
      r.recv = pp.recv != nullptr ? static_cast<unsigned char*>(pp.recv) + part_off : nullptr;
      r.g = g;
      r.send_bytes = partBytes(pp.send_bytes, reg.chunk, j);
      r.recv_bytes = partBytes(pp.recv_bytes, reg.chunk, j);
      r.peer = p;
      wait_lines =
          max(wait_lines, waitedLines(Simple && plan.simple[idx].to_slot != nullptr, r.recv_bytes));
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
  wait_lines = __reduce_max_sync(~0u, wait_lines);
  if (lane != 0) return;
  plan.n = n;
  plan.wait_lines = wait_lines;
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

// One partner's lines (or, simple, payload words) as this thread sees them.
struct Lane {
  unsigned char* to;          // this thread's line to the partner; null: it sends none
  const unsigned char* from;  // its line from the partner
  const unsigned char* send;  // its own word for the partner (null: the common word)
  unsigned char* recv;        // copy mode: where the partner's word goes
  uint32_t g, send_nb, recv_nb;
  bool waits;   // it waits for a line from the partner (a payload or credit line)
  bool simple;  // payload words (the block waits for the partner's flag first)
  int peer;
};

// Route i of the plan for thread t. Simple: the route may be a simple pair's.
template <bool Simple>
__device__ __forceinline__ Lane laneOf(const Plan& plan, uint32_t i, uint32_t t) {
  const Route& r = plan.route[i];
  Lane l;
  l.simple = Simple && plan.simple[i].to_slot != nullptr;
  if (l.simple) {
    l.to = bytesOfLine(r.send_bytes, t) ? r.to + t * 8 : nullptr;
    l.from = r.from + t * 8;
  } else {
    l.to = t < linesOfPart(r.send_bytes) ? r.to + t * 16 : nullptr;
    l.from = r.from + t * 16;
  }
  l.send = r.send != nullptr ? r.send + t * 8 : nullptr;
  l.recv = r.recv != nullptr ? r.recv + t * 8 : nullptr;
  l.g = r.g;
  l.send_nb = r.send != nullptr ? bytesOfLine(r.send_bytes, t) : 0u;
  l.recv_nb = bytesOfLine(r.recv_bytes, t);
  l.waits = t < waitedLines(l.simple, r.recv_bytes);
  l.peer = r.peer;
  return l;
}

// This thread's share of the plan, in registers before the wait: its words' addresses and
// sizes, its lines to and from the first partner (a block's only one at 2 ranks) and, for
// thread 0, the first trigger, so that after the wait the common case reads no shared memory.
template <bool Simple>
struct ThreadPlan {
  const unsigned char* common;
  const unsigned char* self_send;
  unsigned char* self_recv;
  uint32_t common_nb, self_nb;
  uint32_t n, below, triggers;
  bool mine_is_common;
  bool waits;  // a line from some partner (laneOf's Lane::waits for one of them)
  Lane first{};
  TriggerWords trigger0{};

  __device__ ThreadPlan(const Plan& plan, uint32_t t)
      : common(plan.common != nullptr ? plan.common + t * 8 : nullptr),
        self_send(plan.self_send != nullptr ? plan.self_send + t * 8 : nullptr),
        self_recv(plan.self_recv != nullptr ? plan.self_recv + t * 8 : nullptr),
        common_nb(plan.common != nullptr ? bytesOfLine(plan.common_bytes, t) : 0u),
        self_nb(plan.self_recv != nullptr ? bytesOfLine(plan.self_bytes, t) : 0u),
        n(plan.n),
        below(plan.below),
        triggers(plan.triggers),
        mine_is_common(plan.mine_is_common),
        waits(t < plan.wait_lines) {
    if (n > 0) first = laneOf<Simple>(plan, 0, t);
    if (triggers > 0 && t == 0) trigger0 = plan.trigger[0];
  }

  __device__ Lane lane(const Plan& plan, uint32_t i, uint32_t t) const {
    return i == 0 ? first : laneOf<Simple>(plan, i, t);
  }
};

// The op's start: the plan and the round state (warp 0), the advance of the round numbers by
// the last block to have read them, this thread's share of the plan, then the wait for the
// previous kernel (pdlEnter), as enterCollective does for the general kernel.
template <bool Simple>
__device__ __forceinline__ ThreadPlan<Simple> enterOneRound(const CollectiveArgs& a, Shared& sh,
                                                            Plan& plan) {
  if (threadIdx.x < 32) planBlock<Simple>(a, sh, plan);
  advanceOnceLoaded(a, sh);
  const ThreadPlan<Simple> tp(plan, threadIdx.x);
  pdlEnter();
  return tp;
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

__device__ __forceinline__ void sendLane(const Lane& l, uint64_t common) {
  if (l.to == nullptr) return;
  const uint64_t v = l.send_nb ? loadBytes(l.send, l.send_nb) : common;
  if (l.simple)
    storeVolatile64(l.to, v);
  else
    storeLine(l.to, v, l.g);
}

// The op's sending half, shared by both kernels so that they follow one protocol
// (block-uniform): after the wait the trigger positions first thing, this thread's line to
// every partner, and the prepared triggers, which the proxy posts once the lines' flags show.
// Should a push give up (the op was aborted or timed out: Waiter::shouldStop raised `failed`),
// the block's pollers see that and stop. `common`: this thread's common word. Simple: after a
// barrier behind the block's payload words, a thread per simple partner raises the part's
// flag (storeSimpleFlag: its system-scope fence covers every thread's words). Returns the op's
// Waiter.
template <bool Simple>
__device__ __forceinline__ Waiter sendOneRound(const CollectiveArgs& a, const Plan& plan,
                                               const ThreadPlan<Simple>& tp, uint32_t t,
                                               uint64_t& common) {
  const TriggerSpan span(a.reg, tp.triggers);
  Waiter w(a.reg, a.op_id);
  common = tp.common_nb ? loadBytes(tp.common, tp.common_nb) : 0;
  if (tp.n > 0) sendLane(tp.first, common);
  for (uint32_t i = 1; i < tp.n; ++i) sendLane(laneOf<Simple>(plan, i, t), common);
  if constexpr (Simple) {
    __syncthreads();
    for (uint32_t i = t; i < tp.n; i += blockDim.x)
      if (plan.simple[i].to_slot != nullptr)
        storeSimpleFlag(plan.simple[i].to_slot, blockIdx.x, plan.route[i].g);
  }
  if (tp.triggers != 0) {
    pushFromThread0([&] {
      if (!pushTriggerWords(w, span.pos, span.tail_seen, tp.trigger0)) return;
      for (uint32_t i = 1; i < tp.triggers; ++i)
        if (!pushTriggerWords(w, span.pos + i, span.tail_seen, plan.trigger[i])) return;
    });
  }
  return w;
}

// Simple: the block waits (a thread per simple partner) for the partners' flags of its part,
// acquire loads, then a barrier, after which every thread may load their payload words.
// Block-uniform; false in every thread when the op gives up.
template <bool Simple>
__device__ __forceinline__ bool waitSimpleRoutes(Waiter& w, const Plan& plan,
                                                 const ThreadPlan<Simple>& tp, uint32_t t) {
  if constexpr (Simple) {
    bool fail = false;
    for (uint32_t i = t; i < tp.n && !fail; i += blockDim.x)
      if (plan.simple[i].from_slot != nullptr)
        fail = !waitSimpleFlag(w, plan.simple[i].from_slot, blockIdx.x, plan.route[i].g,
                               plan.route[i].peer);
    return !__syncthreads_or(fail);
  } else {
    return true;
  }
}

// A partner's word for this thread: its LL line (polled) or, simple, its payload word (after
// waitSimpleRoutes). False when the op gives up.
__device__ __forceinline__ bool receiveLane(Waiter& w, const Lane& l, uint64_t& v) {
  if (l.simple) {
    v = loadVolatile64(l.from);
    return true;
  }
  return w.line(l.from, l.g, v, l.peer);
}

template <typename Acc, bool Simple>
__global__ void __launch_bounds__(kThreads)
    oneRoundReduce(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  __shared__ Plan plan;
  const uint32_t t = threadIdx.x;
  const ThreadPlan<Simple> tp = enterOneRound<Simple>(a, sh, plan);
  const uint64_t own = tp.self_nb && !tp.mine_is_common ? loadBytes(tp.self_send, tp.self_nb) : 0;
  uint64_t common;
  Waiter w = sendOneRound<Simple>(a, plan, tp, t, common);
  if (!waitSimpleRoutes<Simple>(w, plan, tp, t)) return;
  if (tp.self_nb == 0) {
    // No word of the result here; an op of no bytes still waits for each partner's credit
    // line: a partner may rewrite this op's slot two rounds later only once this rank has read
    // the slot's previous round, which this line vouches for (without the wait a fast rank can
    // rewrite a round a slow one has not read: tests/test_cuda_op_mix.py, 8 ranks, tcp, seed 2).
    // A thread with no line to wait for leaves at once: at 8 B it shares warp 0 with the one
    // thread that reduces, which otherwise waits for it to walk the partners (one H100, 2 ranks,
    // 8 B all_reduce in a graph: 2.87 against 3.06 us, docs/performance.md).
    if (!tp.waits) return;
    for (uint32_t i = 0; i < tp.n; ++i) {
      const Lane l = tp.lane(plan, i, t);
      uint64_t unused;
      if (l.waits && !receiveLane(w, l, unused)) return;
    }
    return;
  }
  const uint64_t mine = tp.mine_is_common ? common : own;
  Acc acc;
  // In rank order, this rank's own bytes in their place: every rank rounds the same.
  for (uint32_t k = 0; k <= tp.n; ++k) {
    uint64_t v = mine;
    if (k != tp.below) {
      const Lane l = tp.lane(plan, k < tp.below ? k : k - 1, t);
      if (!receiveLane(w, l, v)) return;
    }
    if (k == 0)
      acc.first(v);
    else
      acc.fold(a.redop, v);
  }
  storeBytes(tp.self_recv, acc.result(a.redop, a.nranks), tp.self_nb);
}

template <bool Simple>
__global__ void __launch_bounds__(kThreads) oneRoundCopy(const __grid_constant__ CollectiveArgs a) {
  __shared__ Shared sh;
  __shared__ Plan plan;
  const uint32_t t = threadIdx.x;
  const ThreadPlan<Simple> tp = enterOneRound<Simple>(a, sh, plan);
  uint64_t common;
  Waiter w = sendOneRound<Simple>(a, plan, tp, t, common);
  if (tp.self_nb) storeBytes(tp.self_recv, loadBytes(tp.self_send, tp.self_nb), tp.self_nb);
  if (!waitSimpleRoutes<Simple>(w, plan, tp, t)) return;
  for (uint32_t i = 0; i < tp.n; ++i) {
    const Lane l = tp.lane(plan, i, t);
    // An LL credit line is waited for too (slot reuse); a simple partner's flag was already.
    if (!l.waits && !(l.simple && l.recv_nb)) continue;
    uint64_t v;
    if (!receiveLane(w, l, v)) return;
    if (l.recv_nb) storeBytes(l.recv, v, l.recv_nb);
  }
}

}  // namespace

cudaError_t loadOneRoundKernels() {
  cudaError_t err = loadFunctions({reinterpret_cast<const void*>(oneRoundCopy<false>),
                                   reinterpret_cast<const void*>(oneRoundCopy<true>)});
  for (uint8_t code = kF32; err == cudaSuccess && code <= kI8; ++code) {
    err = withAcc(code, [](auto acc) {
      using Acc = decltype(acc);
      return loadFunctions({reinterpret_cast<const void*>(oneRoundReduce<Acc, false>),
                            reinterpret_cast<const void*>(oneRoundReduce<Acc, true>)});
    });
  }
  return err;
}

cudaError_t launchOneRound(const CollectiveArgs& args, unsigned blocks, unsigned threads,
                           cudaStream_t stream) {
  const bool simple = args.reg.simple != 0;
  if (args.mode != static_cast<uint8_t>(Mode::kReduce))
    return simple ? launchKernel<oneRoundCopy<true>>(args, blocks, stream, threads)
                  : launchKernel<oneRoundCopy<false>>(args, blocks, stream, threads);
  return withAcc(args.dtype, [&](auto acc) {
    using Acc = decltype(acc);
    return simple ? launchKernel<oneRoundReduce<Acc, true>>(args, blocks, stream, threads)
                  : launchKernel<oneRoundReduce<Acc, false>>(args, blocks, stream, threads);
  });
}

}  // namespace gpu
}  // namespace resident
