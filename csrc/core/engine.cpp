#include "core/engine.hpp"

#include <algorithm>

#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace resident {
namespace {

constexpr uint64_t kLivenessPeriodNs = 2ull * 1000 * 1000;
// How long past an op's deadline a waiter gives the progress passes to fail it (Engine::wait).
constexpr uint64_t kStuckGraceNs = 5ull * 1000 * 1000 * 1000;
}  // namespace

// A thread inside wait() or begin(), driving progress itself: counted from add() to its end
// (Engine::hasWaiters; the proxy stands by meanwhile). The last one to leave says so
// (setWaitersGone).
class WaiterCount {
 public:
  explicit WaiterCount(Engine& e) : e_(e) {}
  ~WaiterCount() {
    if (on_ && e_.waiters_.fetch_sub(1) == 1 && e_.waiters_gone_ != nullptr)
      e_.waiters_gone_(e_.waiters_gone_ctx_);
  }
  void add() {
    if (on_) return;
    e_.waiters_.fetch_add(1);
    on_ = true;
  }

 private:
  Engine& e_;
  bool on_ = false;
};

std::string rankName(int group_rank, int global_rank) {
  if (global_rank < 0 || global_rank == group_rank) return "rank " + std::to_string(group_rank);
  return "rank " + std::to_string(global_rank) + " (group rank " + std::to_string(group_rank) + ")";
}

Engine::Engine(int rank, int nranks, const Config& cfg, const InboxLayout& layout,
               unsigned char* inbox, Transport* transport, std::vector<PeerInfo> peers,
               std::vector<bool> proxied, TriggerFifo* fifo, uint64_t timeout_ns)
    : rank_(rank),
      nranks_(nranks),
      cfg_(cfg),
      layout_(layout),
      inbox_(inbox),
      transport_(transport),
      peers_(std::move(peers)),
      fifo_(fifo),
      timeout_ns_(timeout_ns),
      spin_ns_(cfg.spin_us * 1000),
      send_(static_cast<size_t>(nranks) * kRings),
      recv_(static_cast<size_t>(nranks) * kRings),
      p2p_bind_(static_cast<size_t>(nranks)),
      lost_(new std::atomic<uint8_t>[static_cast<size_t>(nranks)]),
      lost_why_(static_cast<size_t>(nranks)) {
  for (int p = 0; p < nranks; ++p) lost_[p].store(kPresent, std::memory_order_relaxed);
  pool_.reserve(cfg.max_inflight);
  free_.reserve(cfg.max_inflight);
  active_.reserve(cfg.max_inflight);
  callbacks_.reserve(cfg.max_inflight);
  for (uint32_t i = 0; i < cfg.max_inflight; ++i) {
    pool_.push_back(std::make_unique<Op>());
    pool_.back()->peers.resize(static_cast<size_t>(nranks));
    pool_.back()->reduce_inputs.resize(static_cast<size_t>(nranks));
    free_.push_back(pool_.back().get());
  }
  for (int p = 0; p < nranks; ++p) {
    for (uint32_t k = 0; k < kRings; ++k) {
      const Ring ring = static_cast<Ring>(k);
      SendChannel& s = sendCh(p, ring);
      s.peer = p;
      s.ring = ring;
      s.proxied = proxied[static_cast<size_t>(p)];
      s.acked = &reinterpret_cast<AckLine*>(inbox_ + layout_.ackOffset(p, ring))->consumed;
      s.outbox.resize(layout_.slots());
      RecvChannel& r = recvCh(p, ring);
      r.peer = p;
      r.ring = ring;
      r.proxied = proxied[static_cast<size_t>(p)];
      r.ring_base = inbox_ + layout_.ringOffset(p, ring);
    }
  }
}

Engine::~Engine() {
  poison("the process group was destroyed");
}

void Engine::lock() {
  Backoff backoff(spin_ns_, cfg_.yield_us * 1000, cfg_.max_sleep_us * 1000);
  while (lock_.test_and_set(std::memory_order_acquire)) backoff.pause();
}

bool Engine::tryLock() {
  return !lock_.test_and_set(std::memory_order_acquire);
}

void Engine::unlock() {
  lock_.clear(std::memory_order_release);
  // The callbacks of the ops a holder finished, and those runCallbacks on another thread found
  // the engine taken for: every holder runs them as it lets go (a future whose op finished on
  // the proxy thread while the caller registered its callbacks would otherwise never complete).
  if (has_callbacks_.load(std::memory_order_acquire)) runCallbacks();
}

void Engine::runCallbacks() {
  // Callbacks may re-enter the backend (a future's continuation starting an op), so they run
  // with the engine unlocked; take them out under the lock first.
  constexpr int kBatch = 16;
  std::pair<void (*)(void*), void*> batch[kBatch];
  if (!has_callbacks_.load(std::memory_order_acquire)) return;  // the usual case: one load
  for (;;) {
    int n = 0;
    if (!tryLock()) return;  // whoever holds the engine runs them as it lets go (unlock)
    while (!callbacks_.empty() && n < kBatch) {
      batch[n++] = callbacks_.back();
      callbacks_.pop_back();
    }
    if (callbacks_.empty()) has_callbacks_.store(false, std::memory_order_release);
    lock_.clear(std::memory_order_release);  // not unlock(): this loop runs what is left
    if (n == 0) return;
    for (int i = 0; i < n; ++i) batch[i].first(batch[i].second);
  }
}

Op* Engine::begin() {
  lock();
  if (poisoned()) {
    unlock();
    throw CommError("resident: the process group is unusable after an earlier error: " +
                    poisonReason());
  }
  const uint64_t deadline = nowNs() + timeout_ns_;
  Backoff backoff(spin_ns_, cfg_.yield_us * 1000, cfg_.max_sleep_us * 1000);
  // While it waits for a free op this thread drives progress as wait() does, and counts as a
  // waiter (the proxy then stands by rather than contend for the core).
  WaiterCount waiting(*this);
  while (free_.empty()) {
    waiting.add();
    // All ops in flight: drive them until one finishes and its handle is released.
    bool moved = progressLocked();
    if (!free_.empty()) break;
    unlock();
    // Finished ops whose owners have not released them yet (works nobody waited on): let the
    // owner release them now rather than at its next op, which is this one.
    if (reclaim_ != nullptr) reclaim_(reclaim_ctx_);
    if (assist_ != nullptr && assist_(assist_ctx_)) moved = true;
    if (nowNs() > deadline) {
      throw TimeoutError("resident: " + std::to_string(cfg_.max_inflight) +
                         " operations are in flight and none completed within the timeout "
                         "(raise RESIDENT_MAX_INFLIGHT or wait on earlier async work)");
    }
    if (moved)
      backoff.reset();
    else
      backoff.pause();
    lock();
    if (poisoned()) {
      unlock();
      throw CommError("resident: the process group is unusable after an earlier error: " +
                      poisonReason());
    }
  }
  Op* op = free_.back();
  free_.pop_back();
  for (auto& t : op->peers) t = PeerTransfer{};
  op->ring = kCollectiveRing;
  op->dtype = DType::kBytes;
  op->redop = RedOp::kNone;
  op->seq = 0;
  op->peer = -1;
  op->bytes = 0;
  op->reduce = false;
  op->reduce_local = nullptr;
  op->reduce_out = nullptr;
  op->reduce_bytes = 0;
  op->reduce_chunks = 0;
  op->reduced = 0;
  op->error_kind = ErrorKind::kNone;
  op->error.clear();
  op->released = false;
  op->bound = false;
  op->any_source = false;
  op->any_source_buf = nullptr;
  op->waiting_on = -1;
  op->on_done = nullptr;
  op->on_done_ctx = nullptr;
  return op;
}

void Engine::abandon(Op* op) {
  free_.push_back(op);
  unlock();
}

OpHandle Engine::commit(Op* op) {
  const uint32_t chunk = layout_.slotBytes();
  for (int p = 0; p < nranks_; ++p) {
    PeerTransfer& t = op->peers[static_cast<size_t>(p)];
    if (t.sends) {
      t.send_chunks = chunksFor(t.send_bytes, chunk);
      SendChannel& ch = sendCh(p, op->ring);
      t.send_first = ch.reserved;
      ch.reserved += t.send_chunks;
    }
    if (t.recvs) {
      t.recv_chunks = chunksFor(t.recv_bytes, chunk);
      if (op->ring == kCollectiveRing) {  // p2p receives are matched by tag on arrival
        RecvChannel& ch = recvCh(p, op->ring);
        t.recv_first = ch.reserved;
        ch.reserved += t.recv_chunks;
      }
    }
  }
  if (op->reduce) op->reduce_chunks = chunksFor(op->reduce_bytes, chunk);
  op->start_ns = nowNs();
  op->deadline_ns = op->start_ns + timeout_ns_;
  op->last_liveness_check_ns = op->start_ns;
  // Written under the engine lock only: a store, no read-modify-write.
  const uint64_t generation = op->generation.load(std::memory_order_relaxed) + 1;
  op->generation.store(generation, std::memory_order_release);
  op->state.store(OpState::kActive, std::memory_order_release);
  active_.push_back(op);
  active_count_.fetch_add(1, std::memory_order_release);
  const OpHandle h{op, generation};
  RLOG_TRACE("start %s", op->describe().c_str());
  progressLocked();  // post what can go out now: the peers may already be waiting
  unlock();
  return h;
}

bool Engine::test(OpHandle h) {
  if (finished(h)) return true;
  tryProgress();
  return finished(h);
}

void Engine::wait(OpHandle h, uint64_t timeout_ns) {
  Op& op = *h.op;
  Backoff backoff(spin_ns_, cfg_.yield_us * 1000, cfg_.max_sleep_us * 1000);
  const uint64_t deadline = timeout_ns ? nowNs() + timeout_ns : 0;
  uint64_t locked_ns = 0;  // first clock read since this thread last ran a progress pass
  WaiterCount waiting(*this);
  waiting.add();
  for (;;) {
    const OpState st = op.state.load(std::memory_order_acquire);
    // Released by its owner once it had taken the result (WorkResident::releaseOps), and
    // the slot started another op since: this one finished.
    if (st == OpState::kDone || superseded(h)) return;
    if (st == OpState::kFailed) {
      if (op.error_kind == ErrorKind::kTimeout) throw TimeoutError(op.error);
      throw CommError(op.error);
    }
    if (st == OpState::kFree) {  // the handle's op was released: nothing would ever finish it
      throw CommError("resident: wait() on an operation that was already released (rank " +
                      std::to_string(rank_) + "); please report this");
    }
    bool ran = false;
    bool moved = tryProgress(&ran);
    if (assist_ != nullptr && assist_(assist_ctx_)) moved |= tryProgress(&ran);
    if (moved)
      backoff.reset();
    else
      backoff.pause();
    if (ran) locked_ns = 0;  // this thread had the engine: "since" restarts at the next read
    if (moved && deadline == 0) continue;  // the clock is read only while an op is stuck
    const uint64_t now = nowNs();
    if (locked_ns == 0) locked_ns = now;
    if (deadline != 0 && now > deadline) {
      throw TimeoutError("resident: wait() timed out after " +
                         std::to_string(timeout_ns / 1000000) + " ms on " + op.describe());
    }
    // A progress pass fails an op stuck past its deadline (checkDeadline). One still in flight
    // well past it means no pass could: say so rather than wait on (the group's timeout holds
    // for wait() without one too).
    if (!moved && now > op.deadline_ns + kStuckGraceNs &&
        op.state.load(std::memory_order_acquire) == OpState::kActive) {
      throw TimeoutError(
          "resident: " + op.describe() + " on rank " + std::to_string(rank_) + " is still in " +
          "flight " + std::to_string((now - op.deadline_ns) / 1000000) +
          " ms past the group's timeout, and no progress pass failed it: this thread " +
          (now - locked_ns > kStuckGraceNs
               ? "could not take the group's engine for the last " +
                     std::to_string((now - locked_ns) / 1000000) + " ms (held by another thread)"
               : "ran progress passes") +
          "; please report this with RESIDENT_DEBUG=INFO output");
    }
  }
}

void Engine::release(OpHandle h) {
  lock();
  Op* op = h.op;
  if (op->generation.load() == h.generation && op->state.load() != OpState::kFree) {
    if (op->state.load() == OpState::kActive) {
      op->released = true;  // returned to the pool when it finishes
    } else {
      op->state.store(OpState::kFree, std::memory_order_relaxed);
      free_.push_back(op);
    }
  }
  unlock();
}

void Engine::setCompletionCallback(OpHandle h, void (*fn)(void*), void* ctx) {
  lock();
  Op* op = h.op;
  // A handle whose slot was released and started another op since finished: its callback is
  // due now, not at the end of the slot's new op.
  if (op->state.load() == OpState::kActive && op->generation.load() == h.generation) {
    op->on_done = fn;
    op->on_done_ctx = ctx;
    unlock();
  } else {
    unlock();
    fn(ctx);
  }
}

bool Engine::tryProgress(bool* ran) {
  if (!tryLock()) return false;
  if (ran != nullptr) *ran = true;
  const bool moved = progressLocked();
  unlock();
  return moved;
}

void Engine::finishOp(Op& op, OpState state, ErrorKind kind, const std::string& error) {
  op.error_kind = kind;
  if (!error.empty()) op.error = error;
  if (op.on_done != nullptr) {
    callbacks_.emplace_back(op.on_done, op.on_done_ctx);
    has_callbacks_.store(true, std::memory_order_release);
    op.on_done = nullptr;
  }
  RLOG_TRACE("%s %s", state == OpState::kDone ? "done" : "failed", op.describe().c_str());
  if (op.released) {
    op.state.store(OpState::kFree, std::memory_order_release);
    free_.push_back(&op);
  } else {
    op.state.store(state, std::memory_order_release);
  }
  active_count_.fetch_sub(1, std::memory_order_release);
}

void Engine::poison(const std::string& reason, ErrorKind kind) {
  lock();
  failAllLocked(reason, kind);
  unlock();
}

void Engine::markPeerLost(int peer, const std::string& why, bool failed) {
  std::atomic<uint8_t>& state = lost_[peer];
  if (failed && !any_failed_.load(std::memory_order_relaxed)) {
    {
      std::lock_guard<std::mutex> guard(poison_mu_);
      first_failure_ = why;
    }
    any_failed_.store(true, std::memory_order_release);
  }
  if (state.load(std::memory_order_relaxed) != kPresent) return;
  lost_why_[static_cast<size_t>(peer)] = why;
  state.store(failed ? kFailed : kLeft, std::memory_order_release);  // publishes the reason
}

std::string Engine::firstPeerFailure() const {
  std::lock_guard<std::mutex> guard(poison_mu_);
  return first_failure_;
}

std::string Engine::poisonReason() const {
  std::lock_guard<std::mutex> guard(poison_mu_);
  return poison_reason_;
}

void Engine::failAllLocked(const std::string& reason, ErrorKind kind) {
  if (!poisoned_.load(std::memory_order_relaxed)) {
    {
      std::lock_guard<std::mutex> guard(poison_mu_);
      poison_reason_ = reason;
    }
    poison_kind_.store(kind, std::memory_order_relaxed);
    poisoned_.store(true, std::memory_order_release);
    RLOG_ERROR("%s", reason.c_str());
  }
  for (Op* op : active_) {
    if (op->state.load() == OpState::kActive) finishOp(*op, OpState::kFailed, kind, reason);
  }
  active_.clear();
}

bool Engine::progressLocked() {
  if (active_.empty()) return false;
  bool moved = false;
  try {
    moved |= progressP2PRecvs();
    for (Op* op : active_) {
      if (op->state.load(std::memory_order_relaxed) != OpState::kActive) continue;
      moved |= progressOp(*op);
    }
  } catch (const CommError& e) {
    // A mismatch, a dead peer or a timeout leaves the channels in an unknown state: every op
    // of the group fails with the reason, and later calls refuse to start.
    const ErrorKind kind =
        dynamic_cast<const TimeoutError*>(&e) != nullptr ? ErrorKind::kTimeout : ErrorKind::kComm;
    failAllLocked(e.what(), kind);
    return true;
  } catch (const std::exception& e) {
    // Anything else (an allocation that failed) as well: thrown on, it would leave the engine
    // locked, and every waiter would spin without ever reaching its deadline check.
    failAllLocked(std::string("resident: internal error while moving operations: ") + e.what(),
                  ErrorKind::kComm);
    return true;
  }
  // Drop finished ops, keeping submission order.
  auto live = std::remove_if(active_.begin(), active_.end(), [](Op* op) {
    return op->state.load(std::memory_order_relaxed) != OpState::kActive;
  });
  active_.erase(live, active_.end());
  return moved;
}

bool Engine::progressOp(Op& op) {
  bool moved = false;
  if (op.kind == OpKind::kRecv) {
    if (!op.bound) moved |= deliverFromStash(op);
    op.waiting_on = op.peer;
  } else {
    moved |= progressSends(op);
    moved |= op.reduce ? progressReduce(op) : progressPlaceRecvs(op);
  }
  if (opFinished(op)) {
    finishOp(op, OpState::kDone, ErrorKind::kNone, std::string());
    return true;
  }
  if (!moved) checkDeadline(op, nowNs());  // the clock is read only while an op is stuck
  return moved;
}

bool Engine::opFinished(const Op& op) const {
  // A recv from any source has no transfer until a message is matched to it.
  if (op.any_source && !op.bound) return false;
  for (int p = 0; p < nranks_; ++p) {
    const PeerTransfer& t = op.peers[static_cast<size_t>(p)];
    if (t.sends) {
      if (t.sent < t.send_chunks) return false;
      const SendChannel& ch = send_[static_cast<size_t>(p) * kRings + op.ring];
      // The proxy reads the source bytes: the op is done once they have left.
      if (ch.proxied &&
          ch.transmitted.load(std::memory_order_acquire) < t.send_first + t.send_chunks)
        return false;
    }
    if (t.recvs && t.received < t.recv_chunks) return false;
  }
  return !op.reduce || op.reduced == op.reduce_chunks;
}

void Engine::checkDeadline(Op& op, uint64_t now) {
  const int peer = op.waiting_on;
  auto peer_text = [&] {
    if (peer < 0) return std::string("its peers");
    const PeerInfo& info = peers_[static_cast<size_t>(peer)];
    return info.name + " (pid " + std::to_string(info.pid) + " on " + info.host + ")";
  };
  if (now > op.deadline_ns) {
    throw TimeoutError("resident: " + op.describe() + " on rank " + std::to_string(rank_) +
                       ": Timed out after " + std::to_string((now - op.start_ns) / 1000000) +
                       " ms waiting for " + peer_text() +
                       "; that rank may have crashed, hung, or called a different operation");
  }
  // A peer that is gone (died, failed, or destroyed its group: peer_monitor.hpp) will never
  // answer: say so now rather than at the timeout, if this op still needs it — a chunk to
  // receive from it, or one to send that it must make room for. A peer that already did its
  // part (e.g. left a barrier first) does not fail the op.
  if (now - op.last_liveness_check_ns < kLivenessPeriodNs) return;
  op.last_liveness_check_ns = now;
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    const uint8_t lost = lost_[p].load(std::memory_order_acquire);
    if (lost == kPresent) continue;
    const PeerTransfer& t = op.peers[static_cast<size_t>(p)];
    // A peer that failed fails the op if it is a partner still owed anything (the failure
    // spreads); one that left in order only if a chunk to take from it has not arrived.
    const bool needs = op.kind == OpKind::kRecv ? p == op.peer
                                                : (t.recvs && t.received < t.recv_chunks &&
                                                   (lost == kFailed || !restArrived(op, p))) ||
                                                      (t.sends && t.sent < t.send_chunks);
    if (!needs) continue;
    if (lost == kLeft) noteLeftPeerNeeded(p);
    // Name the other peers gone as well: the first one to go is often the root cause.
    std::string also;
    for (int q = 0; q < nranks_; ++q) {
      if (q != p && q != rank_ && lost_[q].load(std::memory_order_acquire) != kPresent)
        also += "; also gone: " + lost_why_[static_cast<size_t>(q)];
    }
    throw CommError(lost_why_[static_cast<size_t>(p)] + "; " +
                    peers_[static_cast<size_t>(rank_)].name + " was waiting " +
                    (p == peer ? "for it " : "for " + peer_text() + " ") + "in " + op.describe() +
                    also);
  }
}

}  // namespace resident
