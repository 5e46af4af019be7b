// How each operation maps onto the engine's one primitive: per-peer sends, per-peer receives
// (placed, or reduced in rank order chunk by chunk), plus a local copy of this rank's block.
// One-shot for every size: a message larger than a slot is streamed through the ring.
#include <cstring>

#include "core/communicator.hpp"
#include "core/error.hpp"
#include "core/reduce.hpp"

namespace resident {
namespace {

const unsigned char* cbytes(const void* p) {
  return static_cast<const unsigned char*>(p);
}
unsigned char* bytes(void* p) {
  return static_cast<unsigned char*>(p);
}

void localCopy(void* dst, const void* src, size_t n) {
  if (n != 0 && dst != src) std::memmove(dst, src, n);
}

// Fills and starts an op; on an exception while filling, returns the op unused.
template <typename Fill>
OpHandle startOp(Engine& engine, Fill&& fill) {
  Op* op = engine.begin();
  try {
    fill(*op);
  } catch (...) {
    engine.abandon(op);
    throw;
  }
  return engine.commit(op);
}

// A collective of `kind` over `n` bytes (per rank): the group's next collective sequence number.
template <typename Fill>
OpHandle startCollective(Engine& engine, OpKind kind, uint64_t n, Fill&& fill) {
  return startOp(engine, [&](Op& o) {
    o.kind = kind;
    o.bytes = n;
    o.seq = engine.nextCollectiveSeq();
    fill(o);
  });
}

// This op sends `n` bytes from `src` to peer `p`.
void sendTo(Op& o, int p, const void* src, uint64_t n) {
  PeerTransfer& t = o.peers[static_cast<size_t>(p)];
  t.sends = true;
  t.send_ptr = cbytes(src);
  t.send_bytes = n;
}

// This op receives `n` bytes from peer `p` into `dst` (null: reduced, not placed).
void recvFrom(Op& o, int p, void* dst, uint64_t n) {
  PeerTransfer& t = o.peers[static_cast<size_t>(p)];
  t.recvs = true;
  t.recv_ptr = bytes(dst);
  t.recv_bytes = n;
}

// The received blocks are reduced with this rank's `local` block into `out`, in rank order.
void reduceInto(Op& o, DType dtype, RedOp op, const void* local, void* out, uint64_t n) {
  o.dtype = dtype;
  o.redop = op;
  o.reduce = true;
  o.reduce_local = cbytes(local);
  o.reduce_out = bytes(out);
  o.reduce_bytes = n;
}

}  // namespace

void Communicator::checkRank(int r, const char* what) const {
  if (r < 0 || r >= nranks_) {
    throw InvalidArgument(std::string("resident: ") + what + ": rank " + std::to_string(r) +
                          " is out of range for a group of size " + std::to_string(nranks_));
  }
}

void Communicator::checkReduction(DType dtype, RedOp op, const char* what) const {
  if (!reductionSupported(dtype, op)) {
    throw InvalidArgument(std::string("resident: ") + what + " does not support reduce op " +
                          redOpName(op) + " on dtype " + dtypeName(dtype));
  }
}

OpHandle Communicator::allReduce(const void* in, void* out, size_t count, DType dtype, RedOp op) {
  checkReduction(dtype, op, "all_reduce");
  const size_t n = count * dtypeSize(dtype);
  return startCollective(*engine_, OpKind::kAllReduce, n, [&](Op& o) {
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      sendTo(o, p, in, n);
      recvFrom(o, p, nullptr, n);
    }
    reduceInto(o, dtype, op, in, out, n);
  });
}

OpHandle Communicator::reduceScatter(const void* in, void* out, size_t count, DType dtype,
                                     RedOp op) {
  const size_t n = count * dtypeSize(dtype);
  // Reused per thread: no allocation after the first call.
  thread_local std::vector<const void*> blocks;
  blocks.resize(static_cast<size_t>(nranks_));
  for (int p = 0; p < nranks_; ++p)
    blocks[static_cast<size_t>(p)] = cbytes(in) + static_cast<size_t>(p) * n;
  return reduceScatterV(blocks.data(), out, count, dtype, op);
}

OpHandle Communicator::reduceScatterV(const void* const* inputs, void* out, size_t count,
                                      DType dtype, RedOp op) {
  checkReduction(dtype, op, "reduce_scatter");
  const size_t n = count * dtypeSize(dtype);
  return startCollective(*engine_, OpKind::kReduceScatter, n, [&](Op& o) {
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      sendTo(o, p, inputs[p], n);
      recvFrom(o, p, nullptr, n);
    }
    reduceInto(o, dtype, op, inputs[rank_], out, n);
  });
}

OpHandle Communicator::reduce(const void* in, void* out, size_t count, DType dtype, RedOp op,
                              int root) {
  checkRank(root, "reduce");
  checkReduction(dtype, op, "reduce");
  const size_t n = count * dtypeSize(dtype);
  return startCollective(*engine_, OpKind::kReduce, n, [&](Op& o) {
    if (rank_ != root) {
      o.dtype = dtype;
      o.redop = op;
      sendTo(o, root, in, n);
      return;
    }
    for (int p = 0; p < nranks_; ++p)
      if (p != rank_) recvFrom(o, p, nullptr, n);
    reduceInto(o, dtype, op, in, out, n);
  });
}

OpHandle Communicator::allGather(const void* in, void* const* outs, size_t n) {
  localCopy(outs[rank_], in, n);
  return startCollective(*engine_, OpKind::kAllGather, n, [&](Op& o) {
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      sendTo(o, p, in, n);
      recvFrom(o, p, outs[p], n);
    }
  });
}

OpHandle Communicator::gather(const void* in, void* const* outs, size_t n, int root) {
  checkRank(root, "gather");
  if (rank_ == root) localCopy(outs[rank_], in, n);
  return startCollective(*engine_, OpKind::kGather, n, [&](Op& o) {
    if (rank_ != root) {
      sendTo(o, root, in, n);
      return;
    }
    for (int p = 0; p < nranks_; ++p)
      if (p != rank_) recvFrom(o, p, outs[p], n);
  });
}

OpHandle Communicator::scatter(const void* const* ins, void* out, size_t n, int root) {
  checkRank(root, "scatter");
  if (rank_ == root) localCopy(out, ins[rank_], n);
  return startCollective(*engine_, OpKind::kScatter, n, [&](Op& o) {
    if (rank_ != root) {
      recvFrom(o, root, out, n);
      return;
    }
    for (int p = 0; p < nranks_; ++p)
      if (p != rank_) sendTo(o, p, ins[p], n);
  });
}

OpHandle Communicator::allToAll(const void* const* ins, const size_t* in_bytes, void* const* outs,
                                const size_t* out_bytes) {
  if (in_bytes[rank_] != out_bytes[rank_]) {
    throw InvalidArgument("resident: all_to_all: this rank sends itself " +
                          std::to_string(in_bytes[rank_]) + " bytes but expects " +
                          std::to_string(out_bytes[rank_]) + " (split sizes disagree)");
  }
  localCopy(outs[rank_], ins[rank_], in_bytes[rank_]);
  uint64_t total = 0;
  for (int p = 0; p < nranks_; ++p) total += in_bytes[p];
  return startCollective(*engine_, OpKind::kAllToAll, total, [&](Op& o) {
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      sendTo(o, p, ins[p], in_bytes[p]);
      recvFrom(o, p, outs[p], out_bytes[p]);
    }
  });
}

OpHandle Communicator::broadcast(void* buf, size_t n, int root) {
  checkRank(root, "broadcast");
  return startCollective(*engine_, OpKind::kBroadcast, n, [&](Op& o) {
    if (rank_ != root) {
      recvFrom(o, root, buf, n);
      return;
    }
    for (int p = 0; p < nranks_; ++p)
      if (p != rank_) sendTo(o, p, buf, n);
  });
}

OpHandle Communicator::barrier() {
  return startCollective(*engine_, OpKind::kBarrier, 0, [&](Op& o) {
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      sendTo(o, p, nullptr, 0);
      recvFrom(o, p, nullptr, 0);
    }
  });
}

OpHandle Communicator::send(const void* buf, size_t n, int peer, uint64_t tag) {
  checkRank(peer, "send");
  if (peer == rank_) throw InvalidArgument("resident: send to self is not supported");
  return startOp(*engine_, [&](Op& o) {
    o.kind = OpKind::kSend;
    o.ring = kP2PRing;
    o.peer = peer;
    o.seq = tag;
    o.bytes = n;
    sendTo(o, peer, buf, n);
  });
}

OpHandle Communicator::recv(void* buf, size_t n, int peer, uint64_t tag) {
  checkRank(peer, "recv");
  if (peer == rank_) throw InvalidArgument("resident: recv from self is not supported");
  return startOp(*engine_, [&](Op& o) {
    o.kind = OpKind::kRecv;
    o.ring = kP2PRing;
    o.peer = peer;
    o.seq = tag;
    o.bytes = n;
    recvFrom(o, peer, buf, n);
  });
}

OpHandle Communicator::recvAnySource(void* buf, size_t n, uint64_t tag) {
  if (nranks_ == 1)
    throw InvalidArgument(
        "resident: recv from any source in a group of one rank: no peer can send");
  return startOp(*engine_, [&](Op& o) {
    o.kind = OpKind::kRecv;
    o.ring = kP2PRing;
    o.seq = tag;
    o.bytes = n;
    o.any_source = true;
    o.any_source_buf = bytes(buf);
  });
}

}  // namespace resident
