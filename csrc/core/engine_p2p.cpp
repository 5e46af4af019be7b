// The p2p half of the progress engine: messages on the p2p ring are matched to posted
// receives by (peer, tag) as they arrive, or by tag alone for a recv from any source, oldest
// posted receive first; a message nobody waits for yet is stashed.
#include <cstring>

#include "core/engine.hpp"
#include "core/error.hpp"

namespace resident {

void Engine::bindAnySource(Op& op, int peer) {
  op.peer = peer;
  PeerTransfer& t = op.peers[static_cast<size_t>(peer)];
  t.recvs = true;
  t.recv_ptr = op.any_source_buf;
  t.recv_bytes = op.bytes;
  t.recv_chunks = chunksFor(op.bytes, layout_.slotBytes());
}

bool Engine::deliverFromStash(Op& op) {
  for (auto it = stash_.begin(); it != stash_.end(); ++it) {
    Stash& s = **it;
    if (s.tag != op.seq || (!op.any_source && s.peer != op.peer)) continue;
    if (s.received < s.chunks) {
      if (!op.any_source) return false;  // the oldest match is still arriving
      continue;                          // any source: a complete message of another peer may do
    }
    if (op.any_source) {
      // Messages of one peer and tag are received in order: skip this one if an older one
      // of the same peer (still arriving) is ahead of it.
      bool older = false;
      for (auto e = stash_.begin(); e != it && !older; ++e)
        older = (*e)->peer == s.peer && (*e)->tag == s.tag;
      if (older) continue;
      bindAnySource(op, s.peer);
    }
    if (s.total != op.bytes) {
      throw CommError("resident: recv from rank " + std::to_string(op.peer) + " with tag " +
                      std::to_string(op.seq) + " expected " + std::to_string(op.bytes) +
                      " bytes but the matching send carried " + std::to_string(s.total) +
                      " bytes (size mismatch)");
    }
    if (s.total != 0)
      std::memcpy(op.peers[static_cast<size_t>(op.peer)].recv_ptr, s.data.data(), s.total);
    PeerTransfer& t = op.peers[static_cast<size_t>(op.peer)];
    t.received = t.recv_chunks;
    op.bound = true;
    stash_.erase(it);
    return true;
  }
  return false;
}

bool Engine::progressP2PRecvs() {
  bool moved = false;
  const uint32_t chunk = layout_.slotBytes();
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    RecvChannel& ch = recvCh(p, kP2PRing);
    P2PBinding& b = p2p_bind_[static_cast<size_t>(p)];
    for (;;) {
      const SlotHeader* h = readySlot(ch, ch.next);
      if (h == nullptr) break;
      if (b.op == nullptr && b.stash == nullptr) {
        if (h->meta.chunk_index != 0) {
          throw CommError("resident: protocol error on the p2p channel from rank " +
                          std::to_string(p) + " (chunk " + std::to_string(h->meta.chunk_index) +
                          " without a message start)");
        }
        // Match the oldest posted recv with this peer and tag, unless an earlier message
        // with the same tag is stashed (messages with one tag are received in order).
        bool stashed_same_tag = false;
        for (const auto& s : stash_)
          if (s->peer == p && s->tag == h->meta.op_seq) stashed_same_tag = true;
        if (!stashed_same_tag) {
          for (Op* op : active_) {
            if (op->kind == OpKind::kRecv && (op->peer == p || op->any_source) && !op->bound &&
                op->seq == h->meta.op_seq && op->state.load() == OpState::kActive) {
              if (op->any_source) bindAnySource(*op, p);
              validate(*op, *h, p, 0, op->bytes);
              op->bound = true;
              b.op = op;
              break;
            }
          }
        }
        if (b.op == nullptr) {
          // No recv posted for it yet: keep it aside (allocates; only for unexpected order).
          auto s = std::make_unique<Stash>();
          s->peer = p;
          s->tag = h->meta.op_seq;
          s->total = h->meta.total_bytes;
          s->chunks = chunksFor(h->meta.total_bytes, chunk);
          s->received = 0;
          s->data.resize(h->meta.total_bytes);
          b.stash = s.get();
          stash_.push_back(std::move(s));
        }
      }
      const auto* payload = reinterpret_cast<const unsigned char*>(h) + kLine;
      if (b.op != nullptr) {
        PeerTransfer& t = b.op->peers[static_cast<size_t>(p)];
        validate(*b.op, *h, p, t.received, b.op->bytes);
        std::memcpy(t.recv_ptr + static_cast<uint64_t>(t.received) * chunk, payload,
                    h->meta.chunk_bytes);
        if (++t.received == t.recv_chunks) b.op = nullptr;
      } else {
        std::memcpy(b.stash->data.data() + static_cast<uint64_t>(b.stash->received) * chunk,
                    payload, h->meta.chunk_bytes);
        if (++b.stash->received == b.stash->chunks) b.stash = nullptr;
      }
      consumeChunk(ch);
      moved = true;
    }
  }
  return moved;
}

}  // namespace resident
