// Layout of a rank's inbox segment: the memory its peers write into. Every offset is the
// same on all ranks (computed from nranks, slots and slot_bytes), so a sender addresses a
// peer's slot by offset alone, which is what a network transport needs.
//
//   [header line][ack lines: nranks x kRings][peer states: nranks words, whole lines]
//   [rings: nranks x kRings x slots x (header+payload)]
//
// Ring (src, k) of rank r's inbox carries messages src -> r of kind k. Ack line (p, k) of
// rank r's inbox is written by p: how many messages of ring (r, k) in p's inbox p consumed.
// Peer state word p of rank r's inbox is written by p only: whether p's group is still up
// (core/peer_monitor.hpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace resident {

enum Ring : uint32_t { kCollectiveRing = 0, kP2PRing = 1, kRings = 2 };

constexpr size_t kLine = 64;

// What a slot carries besides its payload; written before the flag.
struct SlotMeta {
  uint64_t op_seq;       // collective: the group's op sequence number; p2p: the tag
  uint64_t total_bytes;  // bytes of the whole message (all chunks)
  uint32_t chunk_index;
  uint32_t chunk_bytes;
  uint32_t signature;  // op kind, dtype and reduce op, to catch mismatched calls
  uint32_t reserved;
};

// 64-byte header in front of every slot's payload. `flag` is written last, with release
// ordering: it equals (message sequence on this ring) + 1, so slots never need clearing.
struct alignas(64) SlotHeader {
  SlotMeta meta;
  uint64_t pad[3];
  std::atomic<uint64_t> flag;
};
static_assert(sizeof(SlotHeader) == 64, "slot header is one line");
constexpr size_t kFlagOffsetInHeader = offsetof(SlotHeader, flag);

struct alignas(64) AckLine {
  std::atomic<uint64_t> consumed;
  uint64_t pad[7];
};

struct alignas(64) InboxHeader {
  uint64_t magic;
  uint32_t nranks, slots, slot_bytes, owner_rank;
  uint64_t pad[5];
};
constexpr uint64_t kInboxMagic = 0x5245534944454e54ull;  // "RESIDENT"

// Values of a peer state word.
constexpr uint64_t kPeerStateUp = 0;
constexpr uint64_t kPeerStateLeft = 1;  // the peer shut its group down (destroy, exit)
// The peer's group failed; bits 8-39: 1 + the rank it found dead (0: none, e.g. a timeout or a
// mismatch); bit 40 set when that rank stopped answering over the network (its host or the
// network down, or it hung) rather than exited; bit 41 set when that rank left the group in order
// while an op still needed it (it did not die).
constexpr uint64_t kPeerStateFailed = 2;
constexpr uint64_t kPeerStateDeadMask = 0xffffffffull << 8;
constexpr uint64_t kPeerStateUnreachable = 1ull << 40;
constexpr uint64_t kPeerStateCauseLeft = 1ull << 41;

class InboxLayout {
 public:
  InboxLayout(int nranks, uint32_t slots, uint32_t slot_bytes)
      : nranks_(static_cast<size_t>(nranks)), slots_(slots), slot_bytes_(slot_bytes) {}

  size_t slotStride() const { return kLine + slot_bytes_; }
  size_t ackOffset(int peer, Ring ring) const {
    return kLine + (static_cast<size_t>(peer) * kRings + ring) * kLine;
  }
  size_t peerStateOffset(int peer) const {
    return kLine + nranks_ * kRings * kLine + static_cast<size_t>(peer) * sizeof(uint64_t);
  }
  size_t ringOffset(int src, Ring ring) const {
    const size_t state_lines = (nranks_ * sizeof(uint64_t) + kLine - 1) / kLine;
    return kLine + nranks_ * kRings * kLine + state_lines * kLine +
           (static_cast<size_t>(src) * kRings + ring) * slots_ * slotStride();
  }
  size_t slotOffset(int src, Ring ring, uint64_t seq) const {
    return ringOffset(src, ring) + static_cast<size_t>(seq % slots_) * slotStride();
  }
  size_t totalBytes() const { return ringOffset(static_cast<int>(nranks_), kCollectiveRing); }
  uint32_t slots() const { return slots_; }
  uint32_t slotBytes() const { return slot_bytes_; }

 private:
  size_t nranks_;
  uint32_t slots_;
  uint32_t slot_bytes_;
};

}  // namespace resident
