// Point-to-point: one kernel for send and one for recv, on the caller's stream. Each
// direction of a pair is its own channel of rounds (so a send and a recv between the same two
// ranks never pair up with each other); the receiver returns a credit per round consumed, and
// the sender waits for the credit of round g-2 before reusing its slot. A send therefore
// completes without waiting for the matching recv, up to two rounds ahead.
//
// A round goes as LL lines, or, for an op whose first round exceeds the pair's simplePair
// threshold, as the payload as it is plus one flag per part (simple_device.cuh, the same rule
// and slot layout as the collectives'); the choice is per op, made at launch from the message
// size, which both ends know, so a kernel is built for one protocol (`Simple`). A round is
// credited whole, so a slot is rewritten only after the receiver read every part of it.
#include <cuda_runtime.h>

#include "collective_launch.hpp"
#include "fifo_device.cuh"
#include "launch_device.cuh"
#include "ll_device.cuh"
#include "region_offsets.cuh"
#include "rounds_device.cuh"
#include "simple_device.cuh"

namespace resident {
namespace gpu {
namespace {

// Lines of part j: payload lines, or one credit line for an empty message (part 0 only).
__device__ __forceinline__ uint32_t linesOf(uint32_t round_bytes, uint32_t part) {
  if (round_bytes == 0) return part == 0 ? 1u : 0u;
  return payloadLines(round_bytes, part);
}

// The round number this kernel starts from, read before the wait for the previous kernel of
// the stream (which advanced it before letting this one launch); the last block to have read
// it advances it by `rounds` for the next kernel, before any block lets that one launch.
// Block-uniform (contains barriers).
__device__ inline uint32_t advanceEarly(uint32_t* round, uint32_t* blocks_read, uint32_t rounds) {
  __shared__ uint32_t base;
  if (threadIdx.x == 0) base = *reinterpret_cast<volatile uint32_t*>(round);
  __syncthreads();
  if (threadIdx.x == 0 && lastBlockOf(blocks_read)) {
    *reinterpret_cast<volatile uint32_t*>(round) = base + rounds;
    __threadfence();
  }
  __syncthreads();
  return base;
}

// Flow control before round g: the receiver must have consumed round g - 2 (same slot). Only
// block 0 reads the credit word in host memory and publishes it in device memory, where the
// other blocks poll: uncached reads of one host address from many blocks at once are served one
// after another (~1 us each on the H200 host: 30.7 us for 32 blocks,
// benchmarks/probes/ll_poll_probe.cu), so a 64 KiB send over 16 blocks spent ~15 us here (31
// against 12.7 us one-way). Block 0 takes part in every round (part 0 always has a line), so the
// others never wait on a block that has left. Thread 0 of a block only. `early` (block 0, or null):
// a read of the credit word made before the wait for the previous kernel; credits only grow, so it
// is a safe lower bound.
__device__ inline bool waitCredit(Waiter& w, const P2PArgs& a, uint32_t slot, uint32_t g,
                                  const uint32_t* early) {
  const Region& reg = w.reg;
  volatile uint32_t* cached = &reg.state->p2p_credit[a.peer][slot];
  // Round numbers wrap: `done` is at or past `want` when the difference is non-negative.
  auto reached = [](uint32_t done, uint32_t want) {
    return static_cast<int32_t>(done - want) >= 0;
  };
  if (blockIdx.x != 0) {
    for (uint32_t spins = 0; !reached(*cached, g - 2);)
      if (++spins == 4096) {
        spins = 0;
        if (w.shouldStop(a.peer, kWaitCredit, g - 2)) return false;
      }
    return true;
  }
  const unsigned char* word = reg.local + creditInOffset(reg, a.peer, slot);
  // Block 0 is the cache's only writer while the channel's kernel runs (a channel's kernels run
  // one after another, see advanceEarly), so a plain store, and block 0 decides on the value it
  // read: an atomic or a re-read would put an L2 round trip on the path of every send (with an
  // atomicCAS here the 8 B send/recv read 4.76 us against 4.05 us, H200, bench-p2p).
  uint32_t known = *cached;
  if (early != nullptr && static_cast<int32_t>(*early - known) > 0) *cached = known = *early;
  if (reached(known, g - 2)) return true;
  for (uint32_t spins = 0;;) {
    const uint32_t v = static_cast<uint32_t>(loadVolatile64(word));
    if (static_cast<int32_t>(v - known) > 0) *cached = known = v;  // v is newer
    if (reached(v, g - 2)) return true;
    if (++spins == 64) {
      spins = 0;
      if (w.shouldStop(a.peer, kWaitCredit, g - 2)) return false;
    }
  }
}

template <bool Simple>
__global__ void __launch_bounds__(kThreads) sendKernel(const __grid_constant__ P2PArgs a) {
  __shared__ int stop;
  const Region& reg = a.reg;
  DeviceState* st = reg.state;
  // Round bookkeeping before the wait for the previous kernel, as in collectiveKernel.
  unsigned char* remote = st->remote[a.peer];
  const uint32_t base =
      advanceEarly(&st->p2p_send_round[a.peer], &st->send_blocks_done[a.peer], a.rounds);
  const uint32_t t = threadIdx.x;
  const uint32_t j0 = blockIdx.x * a.parts_per_block;
  // Block 0's read of round 0's credit word goes out before the wait, so that its host round
  // trip (~1 us) overlaps the previous kernel: in a ping-pong the credit the send needs has
  // long arrived, but the device cache of it is refreshed only when a send reads the word,
  // which put a host read on every other send's path.
  uint32_t early = 0;
  if (t == 0) {
    stop = 0;
    if (blockIdx.x == 0)
      early =
          static_cast<uint32_t>(loadVolatile64(reg.local + creditInOffset(reg, a.peer, base & 1)));
  }
  pdlEnter();
  __syncthreads();
  Waiter w(reg, a.op_id);
  // `stop` is only read after a barrier, so every thread leaves the loop in the same round.
  for (uint32_t r = 0; r < a.rounds; ++r) {
    const uint32_t g = base + r + 1;
    const uint32_t slot = (g - 1) & 1;
    const uint32_t bytes = roundBytes(a.bytes, r, reg.chunk);
    // Proxied: the trigger's position is taken once the credit is there, so that its atomic
    // overlaps the line stores; from there on the block waits for nothing before it pushes
    // (a reserved position must be filled without waiting on a peer: the proxy pops in order).
    unsigned long long pos = 0, tail_seen = 0;
    if (t == 0 && !stop) {
      if (!waitCredit(w, a, slot, g, r == 0 && blockIdx.x == 0 ? &early : nullptr)) {
        stop = 1;
      } else if (remote == nullptr && linesOf(bytes, j0) > 0) {
        // Simple: the payload's copy and the flags (pushSimpleRound).
        pos = reserveTriggers(
            reg,
            Simple ? simpleTriggers(simplePayloadBytes(bytes, j0, j0 + a.parts_per_block)) : 1u);
        tail_seen = loadTailCache(reg);
      }
    }
    __syncthreads();
    if (stop) break;
    const uint64_t remote_off = p2pInOffset(reg, a.rank, slot);
    const uint64_t local_off = outP2POffset(reg, a.peer, slot);
    unsigned char* dst = remote ? remote + remote_off : reg.outbox + local_off;
    const auto* src =
        static_cast<const unsigned char*>(a.send) + static_cast<uint64_t>(r) * reg.chunk;
    uint32_t j_end = j0;
    for (uint32_t j = j0; j < j0 + a.parts_per_block; ++j) {
      const uint32_t lines = linesOf(bytes, j);
      if (lines == 0) break;
      j_end = j + 1;
      if (t < lines) {
        const uint32_t nb = lineBytes(bytes, j, t);
        const uint64_t v =
            nb ? loadBytes(src + static_cast<uint64_t>(j) * kPartPayload + t * 8, nb) : 0;
        if (Simple)
          storeVolatile64(dst + simpleWordOffset(reg, j, t), v);
        else
          storeLine(dst + (static_cast<uint64_t>(j) * kThreads + t) * 16, v, g);
      }
    }
    if (Simple && j_end > j0) {
      if (remote) {
        flagSimpleParts(dst, j0, j_end, g);
      } else {
        pushFromThread0([&] {
          if (!pushSimpleRound(w, pos, tail_seen, a.peer, local_off, remote_off, bytes, j0, j_end,
                               g))
            stop = 1;
        });
      }
      continue;
    }
    if (!remote && j_end > j0) {
      pushFromThread0([&] {
        const uint64_t first = static_cast<uint64_t>(j0) * kThreads * 16;
        const uint64_t n =
            (static_cast<uint64_t>(j_end - 1 - j0) * kThreads + linesOf(bytes, j_end - 1)) * 16;
        if (!pushTriggerWords(w, pos, tail_seen,
                              triggerWords(reg, a.peer, local_off + first, remote_off + first, n,
                                           TriggerKind::kLines, g)))
          stop = 1;
      });
    }
  }
}

template <bool Simple>
__global__ void __launch_bounds__(kThreads) recvKernel(const __grid_constant__ P2PArgs a) {
  const Region& reg = a.reg;
  DeviceState* st = reg.state;
  unsigned char* remote = st->remote[a.peer];
  const uint32_t base =
      advanceEarly(&st->p2p_recv_round[a.peer], &st->recv_blocks_done[a.peer], a.rounds);
  pdlEnter();
  Waiter w(reg, a.op_id);
  const uint32_t t = threadIdx.x;
  const uint32_t j0 = blockIdx.x * a.parts_per_block;
  // `fail` is per thread; every exit decision is a __syncthreads_or over it, so all threads of
  // the block leave a loop at the same barrier.
  bool fail = false;
  for (uint32_t r = 0; r < a.rounds; ++r) {
    const uint32_t g = base + r + 1;
    const uint32_t slot = (g - 1) & 1;
    const uint32_t bytes = roundBytes(a.bytes, r, reg.chunk);
    const unsigned char* src = reg.local + p2pInOffset(reg, a.peer, slot);
    auto* dst = static_cast<unsigned char*>(a.recv) + static_cast<uint64_t>(r) * reg.chunk;
    if (Simple) {
      uint32_t j_end = j0;
      while (j_end < j0 + a.parts_per_block && linesOf(bytes, j_end) > 0) ++j_end;
      fail = !recvSimpleParts(w, src, bytes, j0, j_end, g, a.peer, dst);
    }
    // LL: every thread polls its own line; no barrier inside the loop, so a thread that gives
    // up leaves it alone and the block agrees at the __syncthreads_or below.
    for (uint32_t j = j0; !Simple && j < j0 + a.parts_per_block && !fail; ++j) {
      const uint32_t lines = linesOf(bytes, j);
      if (lines == 0) break;
      if (t >= lines) continue;
      uint64_t v;
      if (!w.line(src + (static_cast<uint64_t>(j) * kThreads + t) * 16, g, v, a.peer)) {
        fail = true;
        break;
      }
      const uint32_t nb = lineBytes(bytes, j, t);
      if (nb) storeBytes(dst + static_cast<uint64_t>(j) * kPartPayload + t * 8, v, nb);
    }
    if (__syncthreads_or(fail)) break;
    // The last of the blocks that took part in this round returns its credit to the sender,
    // in a word per slot. Only blocks with lines in the round count: a block without lines
    // waits for nothing and could otherwise count into the slot's next round early.
    // Credits of one slot are written in round order, so a credit never moves backwards.
    const uint32_t parts = partsOf(bytes);
    const uint32_t active = min(gridDim.x, (parts + a.parts_per_block - 1) / a.parts_per_block);
    if (t == 0 && j0 < parts) {
      if (lastOf(&st->p2p_done[a.peer][slot], active)) {
        // A plain store: the credit only has to follow this op's reads of the slot, which
        // completed (their values are used) before the barrier and lastOf's fence.
        // Proxied: into this rank's outbox word for the peer and slot, which the proxy polls
        // and forwards (GpuCommunicator::forwardCredits). A plain store: no FIFO reservation
        // (an atomic round trip) before the kernel may end and the stream's next kernel, a
        // ping-pong's reply, may start.
        storeVolatile64(remote ? remote + creditInOffset(reg, a.rank, slot)
                               : reg.outbox + outCreditOffset(reg, a.peer, slot),
                        g);
      }
    }
  }
}

// The op's protocol (simple_device.cuh): from its first round, which both ends size alike.
bool simpleOp(const P2PArgs& a) {
  const uint32_t first = a.bytes < a.reg.chunk ? static_cast<uint32_t>(a.bytes) : a.reg.chunk;
  return simplePair(a.reg, a.peer, first);
}

}  // namespace

cudaError_t loadP2PKernels() {
  return loadFunctions({reinterpret_cast<const void*>(sendKernel<false>),
                        reinterpret_cast<const void*>(sendKernel<true>),
                        reinterpret_cast<const void*>(recvKernel<false>),
                        reinterpret_cast<const void*>(recvKernel<true>)});
}

cudaError_t launchSend(const P2PArgs& args, unsigned blocks, cudaStream_t stream) {
  return simpleOp(args) ? launchKernel<sendKernel<true>>(args, blocks, stream)
                        : launchKernel<sendKernel<false>>(args, blocks, stream);
}

cudaError_t launchRecv(const P2PArgs& args, unsigned blocks, cudaStream_t stream) {
  return simpleOp(args) ? launchKernel<recvKernel<true>>(args, blocks, stream)
                        : launchKernel<recvKernel<false>>(args, blocks, stream);
}

}  // namespace gpu
}  // namespace resident
