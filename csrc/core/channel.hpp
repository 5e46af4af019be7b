// Per-peer, per-ring channel state. A channel is a ring of slots in the receiver's inbox;
// the sender owns the write cursor and learns about free slots from the ack line the
// receiver writes into the sender's inbox. Sequences are reserved by ops at submission, so
// concurrent ops use a channel strictly in submission order.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "core/layout.hpp"

namespace resident {

// What the proxy needs to transmit one chunk: filled by the op, read by the proxy.
struct OutboxEntry {
  SlotMeta meta;
  const unsigned char* src = nullptr;
};

struct SendChannel {
  int peer = -1;
  Ring ring = kCollectiveRing;
  bool proxied = false;                          // writes go through the proxy thread
  uint64_t reserved = 0;                         // next sequence handed to a new op
  uint64_t next = 0;                             // next sequence to post
  const std::atomic<uint64_t>* acked = nullptr;  // peer's consumed count (our inbox)
  std::atomic<uint64_t> transmitted{0};          // chunks whose bytes left the source
  std::vector<OutboxEntry> outbox;               // one per slot
};

struct RecvChannel {
  int peer = -1;
  Ring ring = kCollectiveRing;
  bool proxied = false;  // acks go through the proxy thread
  uint64_t reserved = 0;
  uint64_t next = 0;                   // next sequence to consume
  unsigned char* ring_base = nullptr;  // our inbox, ring (peer, ring)
};

}  // namespace resident
