#include "core/transport/ib/post_planner.hpp"

#include <algorithm>
#include <string>

#include "core/error.hpp"

namespace resident {
namespace ib {
namespace {

constexpr uint32_t kMaxWrBytes = 1u << 30;  // well below the 2^31 RDMA message limit
constexpr uint64_t kSeqMask = (1ull << 48) - 1;

}  // namespace

const char* completionModeName(CompletionMode mode) {
  switch (mode) {
    case CompletionMode::kFlagInLine:
      return "flag-in-line";
    case CompletionMode::kFlagWrite:
      return "flag-write";
    case CompletionMode::kWriteWithImm:
      return "write-with-imm";
  }
  return "?";
}

PostPlanner::PostPlanner(int npeers, const PlannerConfig& cfg) : cfg_(cfg) {
  if (npeers <= 0 || npeers > 0x7fff)
    throw InvalidArgument("ib planner: peer count out of range: " + std::to_string(npeers));
  if (cfg.sq_depth == 0 || cfg.max_sge == 0 || cfg.signal_every == 0)
    throw InvalidArgument("ib planner: sq_depth, max_sge and signal_every must be positive");
  if (cfg.mode == CompletionMode::kWriteWithImm && cfg.imm_slots == 0)
    throw InvalidArgument("ib planner: write-with-imm needs landing slots");
  peers_.resize(static_cast<size_t>(npeers));
  for (size_t p = 0; p < peers_.size(); ++p) {
    PeerState& ps = peers_[p];
    ps.ring.resize(cfg.sq_depth);
    ps.batch.wrs.reserve(cfg.sq_depth);
    ps.batch.sges.reserve(static_cast<size_t>(cfg.sq_depth) * cfg.max_sge);
  }
  planned_peers_.reserve(peers_.size());
  blocked_.assign(peers_.size(), 0);
}

size_t PostPlanner::plan(const WriteReq* reqs, size_t n, std::vector<WriteReq>* deferred,
                         bool signal_last) {
  for (int p : planned_peers_) {
    PeerBatch& b = peers_[static_cast<size_t>(p)].batch;
    b.peer = -1;
    b.wrs.clear();
    b.sges.clear();
  }
  planned_peers_.clear();
  std::fill(blocked_.begin(), blocked_.end(), 0);

  size_t planned = 0;
  for (size_t i = 0; i < n; ++i) {
    const WriteReq& req = reqs[i];
    if (req.peer < 0 || static_cast<size_t>(req.peer) >= peers_.size())
      throw InvalidArgument("ib planner: write to unknown peer " + std::to_string(req.peer));
    PeerState& ps = peers_[static_cast<size_t>(req.peer)];
    if (blocked_[static_cast<size_t>(req.peer)] || !place(ps, req)) {
      blocked_[static_cast<size_t>(req.peer)] = 1;  // keep the peer's order: defer the rest too
      deferred->push_back(req);
      continue;
    }
    ++planned;
    if (ps.batch.peer < 0 && !ps.batch.wrs.empty()) {
      ps.batch.peer = req.peer;
      planned_peers_.push_back(req.peer);
    }
  }

  for (int p : planned_peers_) {
    PeerState& ps = peers_[static_cast<size_t>(p)];
    std::vector<PlannedWr>& wrs = ps.batch.wrs;
    if (signal_last && !wrs.back().signaled) {
      wrs.back().signaled = true;
      ps.since_signal = 0;
      ps.signaled_tag = std::max(ps.signaled_tag, wrs.back().tag);
    }
    uint64_t running = ps.tag_hi;
    for (PlannedWr& wr : wrs) {
      wr.inline_data = cfg_.max_inline > 0 && wr.bytes <= cfg_.max_inline;
      running = std::max(running, wr.tag);
      if (!wr.signaled) continue;
      const size_t slot = (ps.ring_head + ps.ring_size) % ps.ring.size();
      ps.ring[slot] = Signaled{ps.posted + static_cast<uint64_t>(&wr - wrs.data()), running};
      ++ps.ring_size;
    }
    ps.tag_hi = running;
    ps.posted += wrs.size();
  }
  return planned;
}

bool PostPlanner::place(PeerState& ps, const WriteReq& req) {
  if (req.is_signal) {
    const uint32_t want =
        cfg_.mode == CompletionMode::kWriteWithImm ? kLandingRecordBytes : kFlagBytes;
    if (req.bytes != want)
      throw InvalidArgument("ib planner: a signal stages " + std::to_string(want) +
                            " bytes in this mode, got " + std::to_string(req.bytes));
  } else if (req.bytes == 0) {
    return true;  // nothing to move
  }
  if (tryMerge(ps, req)) return true;
  const uint64_t queued = ps.posted - ps.retired + ps.batch.wrs.size();
  if (queued >= cfg_.sq_depth) return false;
  openWr(ps, req);
  return true;
}

bool PostPlanner::tryMerge(PeerState& ps, const WriteReq& req) {
  if (req.is_signal && cfg_.mode != CompletionMode::kFlagInLine) return false;
  if (ps.batch.wrs.empty()) return false;
  PlannedWr& last = ps.batch.wrs.back();
  if (last.target != WrTarget::kInbox || last.with_imm || last.carries_signal) return false;
  if (last.remote_offset + last.bytes != req.offset) return false;
  if (static_cast<uint64_t>(last.bytes) + req.bytes > kMaxWrBytes) return false;
  abi::Sge& tail = ps.batch.sges.back();
  if (tail.lkey == req.lkey && tail.addr + tail.length == req.local_addr) {
    tail.length += req.bytes;  // local bytes contiguous too: one longer SGE
  } else if (last.num_sge < cfg_.max_sge) {
    ps.batch.sges.push_back(abi::Sge{req.local_addr, req.bytes, req.lkey});
    ++last.num_sge;
  } else {
    return false;
  }
  last.bytes += req.bytes;
  last.tag = std::max(last.tag, req.tag);
  if (req.is_signal) last.carries_signal = true;  // the flag is the last bytes of this write
  checkTagSpan(ps, last);
  return true;
}

void PostPlanner::checkTagSpan(PeerState& ps, PlannedWr& wr) {
  if (!wr.signaled && cfg_.signal_tag_span > 0 &&
      wr.tag >= ps.signaled_tag + cfg_.signal_tag_span) {
    wr.signaled = true;
    ps.since_signal = 0;
  }
  if (wr.signaled) ps.signaled_tag = std::max(ps.signaled_tag, wr.tag);
}

PlannedWr* PostPlanner::openWr(PeerState& ps, const WriteReq& req) {
  PeerBatch& b = ps.batch;
  PlannedWr w;
  const uint64_t seq = ps.posted + b.wrs.size();
  w.wr_id = makeWrId(req.peer, seq);
  w.first_sge = static_cast<uint32_t>(b.sges.size());
  w.num_sge = 1;
  w.bytes = req.bytes;
  w.tag = req.tag;
  w.remote_offset = req.offset;
  b.sges.push_back(abi::Sge{req.local_addr, req.bytes, req.lkey});
  if (req.is_signal) {
    w.carries_signal = true;
    if (cfg_.mode == CompletionMode::kWriteWithImm) {
      const uint32_t slot = static_cast<uint32_t>(ps.imm_next++ % cfg_.imm_slots);
      w.target = WrTarget::kLanding;
      w.remote_offset = static_cast<uint64_t>(slot) * kLandingRecordBytes;
      w.with_imm = true;
      w.imm = slot;
    } else {
      w.fence = cfg_.fence_flag_writes;
    }
  }
  // Selective signalling: every Nth request, and the one that fills the queue.
  const uint64_t queued_after = ps.posted - ps.retired + b.wrs.size() + 1;
  if (++ps.since_signal >= cfg_.signal_every || queued_after >= cfg_.sq_depth) {
    w.signaled = true;
    ps.since_signal = 0;
  }
  b.wrs.push_back(w);
  checkTagSpan(ps, b.wrs.back());
  return &b.wrs.back();
}

uint64_t PostPlanner::complete(uint64_t wr_id, int* peer) {
  const int p = wrPeer(wr_id);
  if (wrIsRecv(wr_id) || static_cast<size_t>(p) >= peers_.size())
    throw CommError("ib: completion for an unknown work request id " + std::to_string(wr_id));
  PeerState& ps = peers_[static_cast<size_t>(p)];
  const uint64_t seq = wrSeq(wr_id);
  while (ps.ring_size > 0) {
    const Signaled s = ps.ring[ps.ring_head];
    ps.ring_head = (ps.ring_head + 1) % ps.ring.size();
    --ps.ring_size;
    if ((s.seq & kSeqMask) == seq) {
      ps.retired = s.seq + 1;
      if (peer) *peer = p;
      return s.tag;
    }
  }
  throw CommError("ib: completion for work request " + std::to_string(seq) + " of peer " +
                  std::to_string(p) + ", which is not outstanding");
}

uint32_t PostPlanner::outstanding(int peer) const {
  const PeerState& ps = peers_[static_cast<size_t>(peer)];
  return static_cast<uint32_t>(ps.posted - ps.retired);
}

}  // namespace ib
}  // namespace resident
