// The collective half of the progress engine: an op's chunks go out through its send channels
// (posted to the transport, or, on a proxied channel, handed to the proxy by a trigger) and come
// in from its receive channels, each slot's header validated before its bytes are placed or
// reduced; a consumed slot is acknowledged to its writer. The p2p half: engine_p2p.cpp.
#include <algorithm>
#include <cstring>

#include "core/clock.hpp"
#include "core/engine.hpp"
#include "core/error.hpp"
#include "core/reduce.hpp"

namespace resident {
namespace {

// A proxy trigger of the engine's channels (Engine::handleTrigger): type, ring and peer.
constexpr int kTriggerTypeShift = 40;
constexpr int kTriggerRingShift = 32;

uint64_t triggerWord(TriggerType type, Ring ring, int peer) {
  return (static_cast<uint64_t>(type) << kTriggerTypeShift) |
         (static_cast<uint64_t>(ring) << kTriggerRingShift) | static_cast<uint32_t>(peer);
}

}  // namespace

bool Engine::progressSends(Op& op) {
  bool moved = false;
  const uint32_t chunk = layout_.slotBytes();
  for (int p = 0; p < nranks_; ++p) {
    PeerTransfer& t = op.peers[static_cast<size_t>(p)];
    if (!t.sends) continue;
    SendChannel& ch = sendCh(p, op.ring);
    while (t.sent < t.send_chunks) {
      const uint64_t seq = t.send_first + t.sent;
      if (ch.next != seq || seq - ch.acked->load(std::memory_order_acquire) >= layout_.slots()) {
        op.waiting_on = p;
        break;
      }
      postChunk(ch, op, t.send_ptr + static_cast<uint64_t>(t.sent) * chunk, t.send_bytes, t.sent);
      ++t.sent;
      moved = true;
    }
  }
  return moved;
}

void Engine::postChunk(SendChannel& ch, const Op& op, const unsigned char* src, uint64_t total,
                       uint32_t chunk) {
  const uint64_t seq = ch.next;
  OutboxEntry& e = ch.outbox[seq % layout_.slots()];
  const uint64_t offset = static_cast<uint64_t>(chunk) * layout_.slotBytes();
  e.meta.op_seq = op.seq;
  e.meta.total_bytes = total;
  e.meta.chunk_index = chunk;
  e.meta.chunk_bytes = static_cast<uint32_t>(
      std::min<uint64_t>(layout_.slotBytes(), total - std::min(total, offset)));
  e.meta.signature = op.signature();
  e.src = src;
  ++ch.next;
  if (ch.proxied) {
    while (!fifo_->tryPush(seq, triggerWord(TriggerType::kTransmit, ch.ring, ch.peer))) cpuRelax();
  } else {
    transmit(ch, seq);
  }
}

void Engine::transmit(SendChannel& ch, uint64_t seq) {
  const OutboxEntry& e = ch.outbox[seq % layout_.slots()];
  const size_t off = layout_.slotOffset(rank_, ch.ring, seq);
  const WriteRegion regions[2] = {{off + kLine, e.src, e.meta.chunk_bytes},
                                  {off, &e.meta, sizeof(SlotMeta)}};
  transport_->writeThenSignal(ch.peer, regions, 2, off + kFlagOffsetInHeader, seq + 1);
  ch.transmitted.store(seq + 1, std::memory_order_release);
}

void Engine::handleTrigger(const Trigger& t) {
  const auto type = static_cast<TriggerType>((t.snd >> kTriggerTypeShift) & 0xff);
  const auto ring = static_cast<Ring>((t.snd >> kTriggerRingShift) & 0xff);
  const int peer = static_cast<int>(t.snd & 0xffffffffu);
  if (type == TriggerType::kTransmit) {
    transmit(sendCh(peer, ring), t.fst);
  } else {
    transport_->signal(peer, layout_.ackOffset(rank_, ring), t.fst);
  }
}

const SlotHeader* Engine::readySlot(RecvChannel& ch, uint64_t seq) const {
  const auto* h = reinterpret_cast<const SlotHeader*>(
      ch.ring_base + static_cast<size_t>(seq % layout_.slots()) * layout_.slotStride());
  return h->flag.load(std::memory_order_acquire) == seq + 1 ? h : nullptr;
}

void Engine::consumeChunk(RecvChannel& ch) {
  const uint64_t consumed = ++ch.next;
  if (ch.proxied) {
    while (!fifo_->tryPush(consumed, triggerWord(TriggerType::kAck, ch.ring, ch.peer))) cpuRelax();
  } else {
    transport_->signal(ch.peer, layout_.ackOffset(rank_, ch.ring), consumed);
  }
}

void Engine::validate(const Op& op, const SlotHeader& h, int peer, uint32_t chunk,
                      uint64_t expected_bytes) const {
  const uint32_t expected_sig = op.kind == OpKind::kRecv
                                    ? opSignature(OpKind::kSend, DType::kBytes, RedOp::kNone)
                                    : op.signature();
  const bool seq_ok = op.kind == OpKind::kRecv || h.meta.op_seq == op.seq;
  if (h.meta.signature == expected_sig && seq_ok && h.meta.total_bytes == expected_bytes &&
      h.meta.chunk_index == chunk)
    return;
  std::string what = "resident: " + op.describe() + " on rank " + std::to_string(rank_) +
                     " does not match rank " + std::to_string(peer) + ": rank " +
                     std::to_string(peer) + " sent " + describeSignature(h.meta.signature) + " (";
  what += op.kind == OpKind::kRecv ? "tag " : "op #";
  what += std::to_string(h.meta.op_seq) + ", " + std::to_string(h.meta.total_bytes) +
          " bytes) where this rank expected " + std::to_string(expected_bytes) + " bytes";
  if (h.meta.total_bytes != expected_bytes) what += " (size mismatch)";
  if (h.meta.signature != expected_sig) what += " (operation or dtype mismatch)";
  what += ". All ranks must call the same collectives in the same order with matching sizes.";
  throw CommError(what);
}

bool Engine::progressPlaceRecvs(Op& op) {
  bool moved = false;
  const uint32_t chunk = layout_.slotBytes();
  for (int p = 0; p < nranks_; ++p) {
    PeerTransfer& t = op.peers[static_cast<size_t>(p)];
    if (!t.recvs) continue;
    RecvChannel& ch = recvCh(p, op.ring);
    while (t.received < t.recv_chunks) {
      const uint64_t seq = t.recv_first + t.received;
      const SlotHeader* h = ch.next == seq ? readySlot(ch, seq) : nullptr;
      if (h == nullptr) {
        op.waiting_on = p;
        break;
      }
      validate(op, *h, p, t.received, t.recv_bytes);
      std::memcpy(t.recv_ptr + static_cast<uint64_t>(t.received) * chunk,
                  reinterpret_cast<const unsigned char*>(h) + kLine, h->meta.chunk_bytes);
      consumeChunk(ch);
      ++t.received;
      moved = true;
    }
  }
  return moved;
}

bool Engine::progressReduce(Op& op) {
  bool moved = false;
  const uint32_t chunk = layout_.slotBytes();
  const size_t elem = dtypeSize(op.dtype);
  while (op.reduced < op.reduce_chunks) {
    const uint32_t k = op.reduced;
    // Every input's chunk k must be here, and (in place) our own chunk k must have left.
    for (int p = 0; p < nranks_; ++p) {
      const PeerTransfer& t = op.peers[static_cast<size_t>(p)];
      if (t.sends && k < t.send_chunks) {
        const SendChannel& ch = send_[static_cast<size_t>(p) * kRings + op.ring];
        if (t.sent <= k ||
            (ch.proxied && ch.transmitted.load(std::memory_order_acquire) <= t.send_first + k)) {
          op.waiting_on = p;
          return moved;
        }
      }
      if (t.recvs) {
        RecvChannel& ch = recvCh(p, op.ring);
        const uint64_t seq = t.recv_first + k;
        const SlotHeader* h = ch.next == seq ? readySlot(ch, seq) : nullptr;
        if (h == nullptr) {
          op.waiting_on = p;
          return moved;
        }
        validate(op, *h, p, k, t.recv_bytes);
        op.reduce_inputs[static_cast<size_t>(p)] =
            reinterpret_cast<const unsigned char*>(h) + kLine;
      }
    }
    const uint64_t off = static_cast<uint64_t>(k) * chunk;
    const uint64_t bytes = std::min<uint64_t>(chunk, op.reduce_bytes - off);
    int n = 0;
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) {
        op.reduce_inputs[static_cast<size_t>(n++)] = op.reduce_local + off;
      } else if (op.peers[static_cast<size_t>(p)].recvs) {
        op.reduce_inputs[static_cast<size_t>(n++)] = op.reduce_inputs[static_cast<size_t>(p)];
      }
    }
    reduceInto(op.dtype, op.redop, op.reduce_out + off, op.reduce_inputs.data(), n, bytes / elem);
    for (int p = 0; p < nranks_; ++p) {
      PeerTransfer& t = op.peers[static_cast<size_t>(p)];
      if (!t.recvs) continue;
      consumeChunk(recvCh(p, op.ring));
      ++t.received;
    }
    ++op.reduced;
    moved = true;
  }
  return moved;
}

bool Engine::restArrived(const Op& op, int p) {
  // A peer that finished its part and left in order may have written every chunk this op still
  // has to take from it (this rank is still reducing or waiting for another peer): those are in
  // this rank's inbox, and the peer is not needed any more.
  const PeerTransfer& t = op.peers[static_cast<size_t>(p)];
  const uint32_t rest = t.recv_chunks - t.received;
  if (rest > layout_.slots()) return false;
  RecvChannel& ch = recvCh(p, op.ring);
  for (uint32_t i = 0; i < rest; ++i)
    if (readySlot(ch, t.recv_first + t.received + i) == nullptr) return false;
  return true;
}

}  // namespace resident
