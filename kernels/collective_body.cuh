// The body of a collective kernel (collective_kernel.cu): every collective is an exchange with a
// set of partner ranks in lockstep rounds. In round r each block writes its parts of the round's
// payload to every partner as LL lines (or a one-line credit where it has nothing for that
// partner), then waits for the partners' lines of the same parts, and reduces or copies them
// into the output. A part's handler sends round r+1 only after it received round r from
// every partner, so a peer can reuse a slot two rounds later without acks: two slots per peer
// suffice. Round numbers per peer live in DeviceState and advance on the device, which is
// what makes a captured graph replayable.
#pragma once

#include "fifo_device.cuh"
#include "kernel_stamps.cuh"
#include "launch_device.cuh"
#include "ll_device.cuh"
#include "reduce_device.cuh"
#include "region_offsets.cuh"
#include "rounds_device.cuh"
#include "simple_device.cuh"

namespace resident {
namespace gpu {

// Lines a part carries: its payload lines, or one credit line when it carries nothing.
__device__ __forceinline__ uint32_t linesOf(uint32_t round_bytes, uint32_t part) {
  const uint32_t n = payloadLines(round_bytes, part);
  return n ? n : 1u;
}

// Bytes of round r in the larger direction with a partner (both sides compute the same).
__device__ __forceinline__ uint32_t pairRoundBytes(const PeerPlan& pp, uint32_t r, uint32_t chunk) {
  return max(roundBytes(pp.send_bytes, r, chunk), roundBytes(pp.recv_bytes, r, chunk));
}

// Parts of round r exchanged with a partner: those of its larger direction (a credit line at
// least), and never fewer than round r-1's (exchangedParts).
__device__ __forceinline__ uint32_t partnerParts(const PeerPlan& pp, uint32_t r, uint32_t chunk) {
  const uint64_t larger = pp.send_bytes > pp.recv_bytes ? pp.send_bytes : pp.recv_bytes;
  return exchangedParts(larger, r, chunk);
}

struct Shared {
  uint32_t base[kMaxRanks];
  unsigned char* remote[kMaxRanks];
  unsigned long long fifo_pos;  // next of the trigger positions reserved for round 0
  int stop;
};

// A point of the op's timeline (kernel_stamps.cuh), once the round state is in `sh`.
__device__ __forceinline__ void stamp(const CollectiveArgs& a, const Shared& sh, StampPoint point) {
  stampAt(
      a.reg, [&] { return sh.base[(a.rank + 1) % a.nranks]; }, point);
}

// Slot of generation g of peer q's rounds in this rank's region (g = sh.base[q] + r + 1 for
// round r of an op): where q writes them, and where the region's owner reads them.
__device__ __forceinline__ const unsigned char* collSlotFrom(const Region& reg, int q, uint32_t g) {
  return reg.local + collInOffset(reg, q, (g - 1) & 1);
}

// Simple protocol, reduce mode: waits (threads in parallel) for the flags of parts [j0, jend)
// from every peer that exchanges this op simple (`first`: the op's first round bytes, see
// simplePair). Block-uniform (a barrier); false when the op gives up (sh.stop is then set for
// the whole block).
__device__ inline bool waitSimpleFlags(const CollectiveArgs& a, Shared& sh, Waiter& w, uint32_t r,
                                       uint32_t first, uint32_t j0, uint32_t jend) {
  const Region& reg = a.reg;
  const uint32_t count = jend > j0 ? jend - j0 : 0u;
  const uint32_t n = static_cast<uint32_t>(a.nranks);
  bool ok = true;
  for (uint32_t i = threadIdx.x; ok && i < count * n; i += blockDim.x) {
    const int q = static_cast<int>(i % n);
    if (q == a.rank || !simplePair(reg, q, first)) continue;
    const uint32_t g = sh.base[q] + r + 1;
    ok = waitSimpleFlag(w, collSlotFrom(reg, q, g), j0 + i / n, g, q);
  }
  if (!ok) sh.stop = 1;
  __syncthreads();
  return !sh.stop;
}

// Reduce mode: waits for the credit lines of parts [j0, jend) of round r (parts past the
// payload, exchangedParts) from every partner that exchanges LL lines (a simple pair's credits
// are its flags, waited for by waitSimpleFlags). False when the op gives up.
__device__ inline bool waitCredits(const CollectiveArgs& a, Shared& sh, Waiter& w, uint32_t r,
                                   uint32_t first, uint32_t j0, uint32_t jend) {
  const uint32_t count = jend > j0 ? jend - j0 : 0u;
  const uint32_t n = static_cast<uint32_t>(a.nranks);
  bool ok = true;
  for (uint32_t i = threadIdx.x; ok && i < count * n; i += blockDim.x) {
    const int q = static_cast<int>(i % n);
    if (q == a.rank || simplePair(a.reg, q, first)) continue;
    const uint32_t g = sh.base[q] + r + 1;
    uint64_t unused;
    ok = w.line(collSlotFrom(a.reg, q, g) + static_cast<uint64_t>(j0 + i / n) * kThreads * 16, g,
                unused, q);
  }
  if (!ok) sh.stop = 1;
  return ok;
}

// Rank-ordered reduction of the parts [j0, j1) of round r. Simple: the kernel is built with
// the simple protocol (RESIDENT_GPU_PROTOCOL=simple; the LL-only build keeps its registers).
template <bool Simple, typename Acc>
__device__ inline void reduceRound(const CollectiveArgs& a, Shared& sh, Waiter& w, uint32_t r,
                                   uint32_t j0, uint32_t j1) {
  const Region& reg = a.reg;
  const uint32_t bytes = roundBytes(a.peers[a.rank].recv_bytes, r, reg.chunk);
  // Parts with payload; a round of no bytes has none: its one part is a credit line, which is
  // waited for like the other credit parts (slot reuse; see exchangedParts).
  const uint32_t nparts = bytes ? partsOf(bytes) : 0u;
  // With credit parts past the payload in a short last round (exchangedParts).
  const uint32_t xparts = exchangedParts(a.peers[a.rank].recv_bytes, r, reg.chunk);
  const uint32_t first = roundBytes(a.peers[a.rank].recv_bytes, 0, reg.chunk);
  const uint64_t round_off = static_cast<uint64_t>(r) * reg.chunk;
  const auto* in = static_cast<const unsigned char*>(a.local_in) + round_off;
  auto* out = static_cast<unsigned char*>(a.out) + round_off;
  const uint32_t t = threadIdx.x;
  // Uniform: the same for every thread (args and byte counts only). In reduce mode every
  // round carries the same bytes both ways with every partner.
  bool any_simple = false;
  for (int q = 0; Simple && q < a.nranks; ++q)
    any_simple |= q != a.rank && simplePair(reg, q, first);
  if (any_simple && !waitSimpleFlags(a, sh, w, r, first, j0, min(j1, xparts))) return;
  if (!waitCredits(a, sh, w, r, first, max(j0, nparts), min(j1, xparts))) return;
  if (r == 0) stamp(a, sh, kStampFlags);
  for (uint32_t j = j0; j < min(j1, nparts); ++j) {
    const uint32_t nb = lineBytes(bytes, j, t);
    if (nb == 0) continue;
    const uint64_t off = static_cast<uint64_t>(j) * kPartPayload + t * 8;
    // This rank's contribution first: its load overlaps the wait instead of following it.
    const uint64_t mine = loadBytes(in + off, nb);
    Acc acc;
    bool ok = true;
    for (int q = 0; q < a.nranks && ok; ++q) {
      uint64_t v = mine;
      if (q != a.rank) {
        const uint32_t g = sh.base[q] + r + 1;
        const unsigned char* slot = collSlotFrom(reg, q, g);
        if (any_simple && simplePair(reg, q, first))
          v = loadVolatile64(slot + simpleWordOffset(reg, j, t));  // its flag was seen
        else
          ok = w.line(slot + (static_cast<uint64_t>(j) * kThreads + t) * 16, g, v, q);
      }
      if (q == 0)
        acc.first(v);
      else
        acc.fold(a.redop, v);
    }
    if (!ok) {
      sh.stop = 1;
      return;
    }
    storeBytes(out + off, acc.result(a.redop, a.nranks), nb);
  }
}

template <bool Simple>
__device__ inline void reduceDispatch(const CollectiveArgs& a, Shared& sh, Waiter& w, uint32_t r,
                                      uint32_t j0, uint32_t j1) {
  withAcc(a.dtype, [&](auto acc) { reduceRound<Simple, decltype(acc)>(a, sh, w, r, j0, j1); });
}

// The trigger of a block's LL lines of parts [j0, j1) of a round carrying `sb` bytes to peer
// p at FIFO position `pos`: one range, every part whole but the last (sendRound). Thread 0.
__device__ __forceinline__ bool pushLinesTrigger(Waiter& w, unsigned long long pos, int p,
                                                 uint64_t local_off, uint64_t remote_off,
                                                 uint32_t sb, uint32_t j0, uint32_t j1,
                                                 uint32_t g) {
  const uint64_t first = static_cast<uint64_t>(j0) * kThreads * 16;
  const uint64_t bytes = (static_cast<uint64_t>(j1 - 1 - j0) * kThreads + linesOf(sb, j1 - 1)) * 16;
  return pushTriggerAt(w, pos, p, local_off + first, remote_off + first, bytes, TriggerKind::kLines,
                       g);
}

// Words a message starts with in place of its payload's: none for the collectives; the
// device-splits all_to_all's counts header (splits_kernel.cu) in its round 0. `covers(o)`: the
// message's word at byte offset o is one of them; `word(p, o)`: that word of the message to p.
struct NoLeadingWords {
  __device__ static constexpr bool covers(uint64_t) { return false; }
  __device__ static uint64_t word(int, uint64_t) { return 0; }
};

// Writes this block's parts of round r to partner p; on the proxy path also hands the range
// to the proxy. Block-uniform control flow (it contains a barrier).
// `pre`: this thread's payload word of (round 0, part j0) when `has_pre` (loaded at start).
// `lead`: the leading words of the message (round 0, LL lines only).
template <bool Simple, class Lead = NoLeadingWords>
__device__ inline void sendRound(const CollectiveArgs& a, Shared& sh, Waiter& w, int p, uint32_t r,
                                 uint32_t j0, uint32_t j1, uint64_t pre, bool has_pre,
                                 const Lead& lead = Lead{}) {
  const Region& reg = a.reg;
  const PeerPlan& pp = a.peers[p];
  const uint32_t sb = roundBytes(pp.send_bytes, r, reg.chunk);
  const uint32_t g = sh.base[p] + r + 1;
  const uint32_t slot = (g - 1) & 1;
  const uint64_t remote_off = collInOffset(reg, a.rank, slot);
  const uint64_t local_off = outCollOffset(reg, p, slot);
  unsigned char* base = sh.remote[p] ? sh.remote[p] + remote_off : reg.outbox + local_off;
  const auto* src =
      static_cast<const unsigned char*>(pp.send) + static_cast<uint64_t>(r) * reg.chunk;
  const uint32_t t = threadIdx.x;
  // Proxied: one trigger covers the block's parts as one range, which the proxy may check line
  // by line (unfenced triggers), so every part but the range's last is written whole (zero
  // payload past the message) — a partial or credit-only part inside the range would leave
  // lines unwritten that the proxy waits for (with several parts per block, a 4-rank uneven
  // all_to_all timed out on the device).
  const bool whole_parts = sh.remote[p] == nullptr;
  if (Simple && simplePair(reg, p, pairRoundBytes(pp, 0, reg.chunk))) {  // payload, flags
    for (uint32_t j = j0; j < j1; ++j) {
      const uint32_t nb = lineBytes(sb, j, t);
      if (nb == 0) continue;
      const uint64_t v = has_pre && r == 0 && j == j0
                             ? pre
                             : loadBytes(src + static_cast<uint64_t>(j) * kPartPayload + t * 8, nb);
      storeVolatile64(base + simpleWordOffset(reg, j, t), v);
    }
    if (sh.remote[p] == nullptr) {
      pushFromThread0([&] {
        const uint32_t n = simpleTriggers(simplePayloadBytes(sb, j0, j1));
        // Round 0 uses the positions reserved at the start of the op (reserveRoundZero).
        const unsigned long long pos = r == 0 ? sh.fifo_pos : reserveTriggers(reg, n);
        if (r == 0) sh.fifo_pos += n;
        if (!pushSimpleRound(w, pos, loadTailCache(reg), p, local_off, remote_off, sb, j0, j1, g))
          sh.stop = 1;
      });
      return;
    }
    flagSimpleParts(base, j0, j1, g);
    return;
  }
  for (uint32_t j = j0; j < j1; ++j) {
    if (t < (whole_parts && j + 1 < j1 ? kThreads : linesOf(sb, j))) {
      const uint32_t nb = lineBytes(sb, j, t);
      const uint64_t o = static_cast<uint64_t>(j) * kPartPayload + t * 8;
      uint64_t v = 0;
      if (has_pre && r == 0 && j == j0)
        v = pre;
      else if (lead.covers(o))
        v = lead.word(p, o);
      else if (nb)
        v = loadBytes(src + o, nb);
      storeLine(base + (static_cast<uint64_t>(j) * kThreads + t) * 16, v, g);
    }
  }
  if (sh.remote[p] == nullptr) {
    pushFromThread0([&] {
      // Round 0 uses the positions reserved at the start of the op (reserveRoundZero).
      const unsigned long long pos = r == 0 ? sh.fifo_pos++ : reserveTriggers(reg, 1);
      if (!pushLinesTrigger(w, pos, p, local_off, remote_off, sb, j0, j1, g)) sh.stop = 1;
    });
  }
}

// Waits for partner p's lines of this block's parts of round r and copies their payload
// (`lead`'s words, read by the caller, stay in the slot).
template <class Lead = NoLeadingWords>
__device__ inline void recvRound(const CollectiveArgs& a, Shared& sh, Waiter& w, int p, uint32_t r,
                                 uint32_t j0, uint32_t j1, const Lead& lead = Lead{}) {
  const Region& reg = a.reg;
  const PeerPlan& pp = a.peers[p];
  const uint32_t rb = roundBytes(pp.recv_bytes, r, reg.chunk);
  const uint32_t g = sh.base[p] + r + 1;
  const unsigned char* base = collSlotFrom(reg, p, g);
  auto* dst = static_cast<unsigned char*>(pp.recv) + static_cast<uint64_t>(r) * reg.chunk;
  const uint32_t t = threadIdx.x;
  for (uint32_t j = j0; j < j1; ++j) {
    if (t >= linesOf(rb, j)) continue;
    uint64_t v;
    if (!w.line(base + (static_cast<uint64_t>(j) * kThreads + t) * 16, g, v, p)) {
      sh.stop = 1;
      return;
    }
    const uint32_t nb = lineBytes(rb, j, t);
    const uint64_t o = static_cast<uint64_t>(j) * kPartPayload + t * 8;
    if (nb && !lead.covers(o)) storeBytes(dst + o, v, nb);
  }
}

// Simple protocol (simplePair): waits for partner p's flags of parts [j0, j1) of round r,
// then copies their payload. Block-uniform (a barrier).
__device__ inline void recvSimple(const CollectiveArgs& a, Shared& sh, Waiter& w, int p, uint32_t r,
                                  uint32_t j0, uint32_t j1) {
  const Region& reg = a.reg;
  const uint32_t g = sh.base[p] + r + 1;
  auto* dst = static_cast<unsigned char*>(a.peers[p].recv) + static_cast<uint64_t>(r) * reg.chunk;
  if (!recvSimpleParts(w, collSlotFrom(reg, p, g), roundBytes(a.peers[p].recv_bytes, r, reg.chunk),
                       j0, j1, g, p, dst))
    sh.stop = 1;
}

// Trigger positions for this block's round-0 writes to proxied partners, taken at the start
// of the op so that the atomic's round trip overlaps the device-state loads. Only round 0:
// a block pushes all of round 0 before it waits for anything, so a reserved position is
// always filled without waiting on a peer (the proxy consumes positions in order). One per
// partner (its lines), or, simple, two (payload and flags) or one (flags only; sendRound).
template <bool Simple>
__device__ inline unsigned long long reserveRoundZero(const CollectiveArgs& a, uint32_t j0) {
  const uint32_t chunk = a.reg.chunk;
  uint32_t n = 0;
  for (int p = 0; p < a.nranks; ++p) {
    const PeerPlan& pp = a.peers[p];
    if (p == a.rank || pp.rounds == 0 || ((a.reg.proxied >> p) & 1) == 0) continue;
    const uint32_t parts = partnerParts(pp, 0, chunk);
    if (j0 >= parts) continue;
    const uint32_t j1 = min(parts, j0 + a.parts_per_block);
    if (Simple && simplePair(a.reg, p, pairRoundBytes(pp, 0, chunk)))
      n += simpleTriggers(simplePayloadBytes(roundBytes(pp.send_bytes, 0, chunk), j0, j1));
    else
      ++n;
  }
  return n ? reserveTriggers(a.reg, n) : 0ull;
}

// The op's round numbers with each partner and the partners' mapped regions, into shared
// memory (visible after the next barrier, the first one of collectiveBody).
__device__ inline void loadRoundState(const CollectiveArgs& a, Shared& sh) {
  DeviceState* st = a.reg.state;
  for (int p = threadIdx.x; p < a.nranks; p += blockDim.x) {
    sh.base[p] = *reinterpret_cast<volatile uint32_t*>(&st->coll_round[p]);  // not from L1
    sh.remote[p] = st->remote[p];
  }
}

template <bool Simple>
__device__ inline void runRounds(const CollectiveArgs& a, Shared& sh, Waiter& w, uint32_t r_begin,
                                 uint32_t j0, uint64_t pre, bool has_pre);

// Runs this block's share of every round of collective `a`, whose
// round state the caller loaded (loadRoundState); on return (block-uniform, after a barrier)
// the block is done with the op. The caller advances DeviceState::coll_round (advanceRounds)
// once every block has loaded it.
template <bool Simple>
__device__ inline void collectiveBody(const CollectiveArgs& a, Shared& sh) {
  const uint32_t chunk = a.reg.chunk;
  const uint32_t j0 = blockIdx.x * a.parts_per_block;
  // Optional (RESIDENT_GPU_PREFETCH): the first payload word, loaded before the trigger
  // reservation and the barrier rather than after them.
  uint64_t pre = 0;
  if (a.common_send != nullptr) {
    const uint32_t nb = lineBytes(roundBytes(a.common_send_bytes, 0, chunk), j0, threadIdx.x);
    if (nb)
      pre = loadBytes(static_cast<const unsigned char*>(a.common_send) +
                          static_cast<uint64_t>(j0) * kPartPayload + threadIdx.x * 8,
                      nb);
  }
  const bool has_pre = a.common_send != nullptr;
  if (threadIdx.x == 0) {
    sh.stop = 0;
    sh.fifo_pos = reserveRoundZero<Simple>(a, j0);
  }
  __syncthreads();
  Waiter w(a.reg, a.op_id);
  runRounds<Simple>(a, sh, w, 0, j0, pre, has_pre);
  __syncthreads();
}

// Rounds [r_begin, rounds_max) of collective `a` for this block's parts from j0 (the loop of
// collectiveBody; splits_kernel.cu's counts-in-header exchange runs its round 0 itself).
// Block-uniform; stops early once the op gave up (sh.stop).
template <bool Simple>
__device__ inline void runRounds(const CollectiveArgs& a, Shared& sh, Waiter& w, uint32_t r_begin,
                                 uint32_t j0, uint64_t pre, bool has_pre) {
  const uint32_t chunk = a.reg.chunk;
  for (uint32_t r = r_begin; r < a.rounds_max; ++r) {
    // Partners of this round, and the parts of it this block handles.
    for (int p = 0; p < a.nranks; ++p) {
      const PeerPlan& pp = a.peers[p];
      if (p == a.rank || r >= pp.rounds) continue;
      const uint32_t n = partnerParts(pp, r, chunk);
      if (j0 < n)
        sendRound<Simple>(a, sh, w, p, r, j0, min(n, j0 + a.parts_per_block), pre, has_pre);
    }
    if (r == 0) stamp(a, sh, kStampSent);
    const PeerPlan& self = a.peers[a.rank];
    if (a.mode == static_cast<uint8_t>(Mode::kReduce)) {
      reduceDispatch<Simple>(a, sh, w, r, j0, j0 + a.parts_per_block);
    } else {
      if (r < self.rounds && self.recv != nullptr && self.send_bytes > 0) {
        const uint32_t b = roundBytes(self.send_bytes, r, chunk);
        const uint32_t n = partsOf(b);
        const uint64_t off = static_cast<uint64_t>(r) * chunk;
        for (uint32_t j = j0; j < min(n, j0 + a.parts_per_block); ++j) {
          const uint32_t nb = lineBytes(b, j, threadIdx.x);
          const uint64_t o = off + static_cast<uint64_t>(j) * kPartPayload + threadIdx.x * 8;
          if (nb)
            storeBytes(static_cast<unsigned char*>(self.recv) + o,
                       loadBytes(static_cast<const unsigned char*>(self.send) + o, nb), nb);
        }
      }
      if constexpr (Simple) {
        // No early exit on sh.stop: a simple receive holds a barrier, so every thread of the
        // block must reach the same calls (an LL receive is skipped once the op gave up).
        for (int p = 0; p < a.nranks; ++p) {
          const PeerPlan& pp = a.peers[p];
          if (p == a.rank || r >= pp.rounds) continue;
          const uint32_t n = partnerParts(pp, r, chunk);
          if (j0 >= n) continue;
          const uint32_t j1 = min(n, j0 + a.parts_per_block);
          if (simplePair(a.reg, p, pairRoundBytes(pp, 0, chunk)))
            recvSimple(a, sh, w, p, r, j0, j1);
          else if (!sh.stop)
            recvRound(a, sh, w, p, r, j0, j1);
        }
      } else {
        for (int p = 0; p < a.nranks && !sh.stop; ++p) {
          const PeerPlan& pp = a.peers[p];
          if (p == a.rank || r >= pp.rounds) continue;
          const uint32_t n = partnerParts(pp, r, chunk);
          if (j0 < n) recvRound(a, sh, w, p, r, j0, min(n, j0 + a.parts_per_block));
        }
      }
    }
    if (r == 0) stamp(a, sh, kStampReceived);
    __syncthreads();
    if (sh.stop) break;
  }
}

// Called by one thread once every block of the op has loaded its round state: the next op
// continues the round numbering with each partner. Every block read the same numbers into
// sh.base (nothing else changes them), so this stores without reading them again.
__device__ inline void advanceRounds(const CollectiveArgs& a, const Shared& sh) {
  DeviceState* st = a.reg.state;
  for (int p = 0; p < a.nranks; ++p) {
    if (p == a.rank) continue;
    // volatile: the next op's kernel reads it on other SMs, possibly while this one still
    // runs (PDL).
    *reinterpret_cast<volatile uint32_t*>(&st->coll_round[p]) = sh.base[p] + a.peers[p].rounds;
  }
}

// Once every block of the op loaded its round state into `sh`: the last block to have done so
// advances the round numbers for the next op, before any thread of this kernel lets that one
// launch (pdlEnter). Block-uniform (barriers).
__device__ __forceinline__ void advanceOnceLoaded(const CollectiveArgs& a, const Shared& sh) {
  __syncthreads();
  if (threadIdx.x == 0 && lastBlockOf(&a.reg.state->coll_blocks_done)) {
    advanceRounds(a, sh);
    __threadfence();
  }
  __syncthreads();
}

// A collective kernel's start: this op's round numbers, which the previous op advanced before
// it let this kernel launch, and then this op's own advance (by the last block to have read
// them), before this kernel lets the next one launch; then the wait for the previous kernel of
// the stream. So the device-state loads overlap the previous kernel instead of following it.
// An op of one round lets the next kernel launch here (pdlEnter); an op of several rounds only
// when its blocks exit: a successor launched at its start would sit resident, in its
// griddepcontrol.wait, through every round of waiting on peers, and with 8 ranks sharing one
// GPU under MPS a captured 256 KiB all_reduce followed by an all_to_all then stalled until the
// group's timeout (the 8-rank graph suite on the proxy path, docs/decisions.md).
__device__ __forceinline__ void enterCollective(const CollectiveArgs& a, Shared& sh) {
  loadRoundState(a, sh);
  advanceOnceLoaded(a, sh);
  pdlWait();
  if (a.rounds_max <= 1) pdlLaunchDependents();
}

}  // namespace gpu
}  // namespace resident
