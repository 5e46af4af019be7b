// Device half of the "simple" protocol (RESIDENT_GPU_PROTOCOL=simple for direct pairs,
// RESIDENT_GPU_PROXY_SIMPLE_ABOVE for proxied ones; collectives and send/recv alike): for a
// large round to a peer, the payload is stored as it is (8 bytes per thread and part, the LL cut
// without the flags), then, after a system-scope fence, one flag line per part. LL lines spend
// 16 bytes on 8 payload bytes; here the bytes that cross PCIe (and, proxied, that the proxy or
// the NIC moves) are halved, for one more dependent load on the reader (flag, then payload). A
// proxied writer stores the payload into its outbox and pushes two triggers: the payload as a
// fenced copy, then the parts' flags (TriggerKind::kFlag), which the proxy raises as transport
// signals, ordered behind the copy.
//
// Where it lives in a slot (2 x chunk bytes, see GpuLayout::slotBytes): payload in
// [chunk, 2 x chunk); flag of part j on the 16-byte line at j x kSimpleFlagStride (a cache
// line each) in [0, chunk), written {0, g, 0, g}. A
// pair with the protocol on exchanges an op as LL lines only when both directions of its first
// (largest) round carry at most its threshold, never above chunk/2 bytes — then the op has one
// round, whose lines,
// credit lines included (a direction with less to send still sends one line per part of the
// larger one), fit in [0, chunk), so LL lines never overlap simple payload: stale payload (any
// bytes) must never be read as an LL line, whose validity is two words equal to the
// generation. Flag lines and LL lines share [0, chunk), and both hold only generations in their
// flag words (older rounds of the slot hold older generations), so neither is mistaken for the
// other. Per op, not per round: LL lines of part 0 cover the flags of parts 1..63 of the
// round two before in the same slot, which other blocks may not have read yet (a short LL last
// round after simple rounds: one of the two ways a 1 MiB all_reduce read wrong data on the
// H200);
// between ops the slot's earlier round was consumed whole (exchangedParts). The decision needs no
// coordination: both sides of a pair compute it from the op's byte counts in both directions and
// the pair's rule (simplePair: direct both ways, or proxied in at least one direction; all ranks
// agree on both settings, checked when the communicator is set up).
#pragma once

#include <cstdint>

#include "exchange_args.hpp"
#include "fifo_device.cuh"
#include "ll_device.cuh"
#include "rounds_device.cuh"

namespace resident {
namespace gpu {

// Offset, from the start of a slot, of the payload word of thread t in part j.
__device__ __forceinline__ uint64_t simpleWordOffset(const Region& reg, uint32_t j, uint32_t t) {
  return reg.chunk + static_cast<uint64_t>(j) * kPartPayload + t * 8;
}

// After a barrier behind the block's payload stores: the flag line of part j carrying
// generation g. The system-scope fence is cumulative: it orders the stores the barrier made
// this thread observe (every thread's payload) before the flag, for any reader, so the
// writers need no fence of their own.
__device__ __forceinline__ void storeSimpleFlag(unsigned char* slot, uint32_t j, uint32_t g) {
  __threadfence_system();
  storeLine(slot + static_cast<uint64_t>(j) * kSimpleFlagStride, 0, g);
}

// Direct writer, after its payload stores of parts [j0, j1): a barrier (the block's stores),
// then the parts' flags carrying g, a thread per part. Block-uniform.
__device__ __forceinline__ void flagSimpleParts(unsigned char* slot, uint32_t j0, uint32_t j1,
                                                uint32_t g) {
  __syncthreads();
  for (uint32_t j = j0 + threadIdx.x; j < j1; j += blockDim.x) storeSimpleFlag(slot, j, g);
}

// The word of part j's flag line that a reader polls, and what it holds once the flag of
// generation g is there: the line's upper half {0, g}. A direct writer stores the whole line;
// for a proxied pair the proxy raises just this word (TriggerKind::kFlag), with the transport's
// release semantics behind the payload it posted before. Its upper 4 bytes are an LL line's
// flag word, so older lines and flags of the slot (older generations) never match.
__device__ __forceinline__ uint64_t simpleFlagWordOffset(uint32_t j) {
  return static_cast<uint64_t>(j) * kSimpleFlagStride + 8;
}
__device__ __forceinline__ uint64_t simpleFlagWord(uint32_t g) {
  return static_cast<uint64_t>(flagOf(g)) << 32;
}

// Triggers a block pushes for a proxied simple round whose parts carry `payload` bytes: the
// payload's copy (when there is any) and the parts' flags.
__device__ __forceinline__ uint32_t simpleTriggers(uint32_t payload) {
  return payload ? 2u : 1u;
}

// Proxied writer, thread 0 once the block's payload stores of parts [j0, j1) are behind a
// barrier (pushFromThread0): their triggers at positions pos, pos + 1 (simpleTriggers of the
// parts' payload, reserved by the caller): the payload as a fenced copy from the outbox slot at
// `local_slot` to the peer's slot at `remote_slot` (the trigger's release store orders the
// block's stores before it), then the parts' flags, which the proxy raises only after it posted
// the copy (FIFO order). False when the op gives up.
__device__ inline bool pushSimpleRound(Waiter& w, unsigned long long pos,
                                       unsigned long long tail_seen, int peer, uint64_t local_slot,
                                       uint64_t remote_slot, uint32_t round_bytes, uint32_t j0,
                                       uint32_t j1, uint32_t g) {
  const Region& reg = w.reg;
  const uint32_t payload = simplePayloadBytes(round_bytes, j0, j1);
  const uint64_t words = simpleWordOffset(reg, j0, 0);
  if (payload != 0 &&
      !pushTriggerWords(w, pos++, tail_seen,
                        triggerWords(reg, peer, local_slot + words, remote_slot + words, payload,
                                     TriggerKind::kCopy, 0)))
    return false;
  return pushTriggerWords(w, pos, tail_seen,
                          triggerWords(reg, peer, 0, remote_slot + j0 * kSimpleFlagStride,
                                       (j1 - j0) * kSimpleFlagStride, TriggerKind::kFlag, g));
}

// Polls the flag of part j until it carries g, with acquire loads; false when the op gives
// up. On success the payload stores that preceded the flag are visible to this thread's later
// loads, and to the block's after a barrier.
__device__ __forceinline__ bool waitSimpleFlag(Waiter& w, const unsigned char* slot, uint32_t j,
                                               uint32_t g, int peer) {
  return w.acquireWord(slot + simpleFlagWordOffset(j), simpleFlagWord(g), peer);
}

// Reader of parts [j0, j1) of a simple round carrying `round_bytes` from `peer` in `slot`:
// waits for their flags (a thread per part), then, after a barrier, copies their payload to
// `dst` (the round's start in the user buffer). Block-uniform: false in every thread when the
// op gives up.
__device__ inline bool recvSimpleParts(Waiter& w, const unsigned char* slot, uint32_t round_bytes,
                                       uint32_t j0, uint32_t j1, uint32_t g, int peer,
                                       unsigned char* dst) {
  const uint32_t t = threadIdx.x;
  bool fail = false;
  for (uint32_t j = j0 + t; j < j1 && !fail; j += blockDim.x)
    fail = !waitSimpleFlag(w, slot, j, g, peer);
  if (__syncthreads_or(fail)) return false;
  for (uint32_t j = j0; j < j1; ++j) {
    const uint32_t nb = lineBytes(round_bytes, j, t);
    if (nb)
      storeBytes(dst + static_cast<uint64_t>(j) * kPartPayload + t * 8,
                 loadVolatile64(slot + simpleWordOffset(w.reg, j, t)), nb);
  }
  return true;
}

}  // namespace gpu
}  // namespace resident
