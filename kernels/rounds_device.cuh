// How a message is cut into rounds (one chunk per round and peer), parts (2 KiB per thread
// block pass) and LL lines (8 payload bytes), and which protocol a pair's op uses. Both sides
// of a channel compute the same from the byte counts alone. Host and device code: the CPU test
// tests/cpp/test_slot_protocol.cpp checks the slot-reuse rules against a model.
#pragma once

#include <cstdint>

#include "exchange_args.hpp"
#include "host_device.hpp"

namespace resident {
namespace gpu {

// Rounds of a pair whose larger direction carries `bytes` (at least one: an empty exchange still
// sends its credit lines).
RESIDENT_HOST_DEVICE_INLINE uint64_t roundsOfBytes(uint64_t bytes, uint32_t chunk) {
  const uint64_t r = (bytes + chunk - 1) / chunk;
  return r == 0 ? 1u : r;
}

// Payload bytes of round r of a message of `total` bytes.
RESIDENT_HOST_DEVICE_INLINE uint32_t roundBytes(uint64_t total, uint32_t r, uint32_t chunk) {
  const uint64_t off = static_cast<uint64_t>(r) * chunk;
  if (off >= total) return 0u;
  const uint64_t left = total - off;
  return static_cast<uint32_t>(left < chunk ? left : chunk);
}

// Parts of a round that carries `bytes` (at least one: an empty exchange still sends a credit).
RESIDENT_HOST_DEVICE_INLINE uint32_t partsOf(uint32_t bytes) {
  const uint32_t n = (bytes + kPartPayload - 1) / kPartPayload;
  return n ? n : 1u;
}

// Parts exchanged in round r of a pair whose larger direction carries `total` bytes: the
// round's own, and at least as many as round r-1's, so a short last round carries a credit
// line for every part of the round before it. Why: a slot is rewritten two rounds later (by
// the next op, after a last round) once the writer received the round in between, which the
// reader sends per part only after it consumed the slot's part; a part missing from the
// round in between would leave the writer free to overwrite it unread (on the H200 with the
// simple protocol that made a 1 MiB all_reduce read wrong data, then the next op time out).
RESIDENT_HOST_DEVICE_INLINE uint32_t exchangedParts(uint64_t total, uint32_t r, uint32_t chunk) {
  const uint32_t n = partsOf(roundBytes(total, r, chunk));
  if (r == 0) return n;
  const uint32_t before = partsOf(roundBytes(total, r - 1, chunk));
  return n > before ? n : before;
}

// The simple protocol (simple_device.cuh): does an op with `peer` whose first (largest) round's
// larger direction carries `first_bytes` go simple in every round, or as LL lines in every
// round? Per op, not per round: see simple_device.cuh. Direct pairs: above 32 KiB with
// RESIDENT_GPU_PROTOCOL=simple; proxied pairs: above the threshold of their rule (each at most
// half a chunk, so that an op's LL lines always fit below the simple payload).
RESIDENT_HOST_DEVICE_INLINE uint32_t pairRule(const Region& reg, int peer) {
  return static_cast<uint32_t>(((reg.proxy_rule >> peer) & 1ull) +
                               ((reg.network_rule >> peer) & 1ull));
}
RESIDENT_HOST_DEVICE_INLINE bool simplePair(const Region& reg, int peer, uint32_t first_bytes) {
  return first_bytes > reg.simple_above[pairRule(reg, peer)];
}

// Payload bytes of part j of a round carrying `round_bytes` (may be <= 0).
RESIDENT_HOST_DEVICE_INLINE int64_t partLen(uint32_t round_bytes, uint32_t part) {
  return static_cast<int64_t>(round_bytes) - static_cast<int64_t>(part) * kPartPayload;
}

// Simple protocol, proxied pair: bytes of the payload words that parts [j0, j1) of a round
// carrying `round_bytes` hold, as one range from part j0's first word (8-byte words: a
// partial last word is posted whole). 0 when the parts carry only flags.
RESIDENT_HOST_DEVICE_INLINE uint32_t simplePayloadBytes(uint32_t round_bytes, uint32_t j0,
                                                        uint32_t j1) {
  const int64_t len = partLen(round_bytes, j0);
  if (len <= 0 || j1 <= j0) return 0u;
  const int64_t most = static_cast<int64_t>(j1 - j0) * kPartPayload;
  return static_cast<uint32_t>(((len < most ? len : most) + 7) / 8 * 8);
}

// Payload lines of a part (0 when it carries nothing).
RESIDENT_HOST_DEVICE_INLINE uint32_t payloadLines(uint32_t round_bytes, uint32_t part) {
  const int64_t len = partLen(round_bytes, part);
  if (len <= 0) return 0u;
  const int64_t lines = (len + 7) / 8;
  return static_cast<uint32_t>(lines < kThreads ? lines : kThreads);
}

// Bytes carried by line t of part j (0 for a credit line).
RESIDENT_HOST_DEVICE_INLINE uint32_t lineBytes(uint32_t round_bytes, uint32_t part, uint32_t t) {
  const int64_t len = partLen(round_bytes, part) - static_cast<int64_t>(t) * 8;
  if (len <= 0) return 0u;
  return static_cast<uint32_t>(len < 8 ? len : 8);
}

// The one-round kernel's cut (one_round_kernel.cu): a block's part of the first round in 32-bit
// arithmetic, computed once before the wait for the previous kernel, and per line after it. The
// same lines as lineBytes and payloadLines (tests/cpp/test_one_round_parts.cpp), so that ops of
// either kernel follow each other on a channel.
// Payload bytes of part j of the first round of a message of `total` bytes (0 .. 2 KiB).
RESIDENT_HOST_DEVICE_INLINE uint32_t partBytes(uint64_t total, uint32_t chunk, uint32_t j) {
  const int64_t len = partLen(roundBytes(total, 0, chunk), j);
  if (len <= 0) return 0u;
  return static_cast<uint32_t>(len < kPartPayload ? len : kPartPayload);
}

// Bytes line t of a part of `part_bytes` carries (0: past the payload, or a credit line).
RESIDENT_HOST_DEVICE_INLINE uint32_t bytesOfLine(uint32_t part_bytes, uint32_t t) {
  const int32_t len = static_cast<int32_t>(part_bytes) - static_cast<int32_t>(t * 8);
  if (len <= 0) return 0u;
  return len < 8 ? static_cast<uint32_t>(len) : 8u;
}

// Lines of a part: its payload lines, or one credit line when it carries nothing.
RESIDENT_HOST_DEVICE_INLINE uint32_t linesOfPart(uint32_t part_bytes) {
  return part_bytes ? (part_bytes + 7) / 8 : 1u;
}

}  // namespace gpu
}  // namespace resident
