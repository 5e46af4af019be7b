// The progress engine of one communicator: the op pool, the channels, and the non-blocking
// state machine that moves every active op forward. Whoever holds the engine (a caller
// waiting on an op, or the proxy thread for async ops) drives it; nobody blocks inside it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/channel.hpp"
#include "core/config.hpp"
#include "core/layout.hpp"
#include "core/op.hpp"
#include "core/proxy/fifo.hpp"
#include "core/transport/transport.hpp"

namespace resident {

struct PeerInfo {
  int pid = 0;
  bool same_host = false;
  std::string host;
  // How messages name the rank: "rank 5" (its global rank), plus "(group rank 1)" in a
  // subgroup where the two differ.
  std::string name;
};

// PeerInfo::name of group rank `group_rank`, global rank `global_rank` (-1: unknown).
std::string rankName(int group_rank, int global_rank);

enum class TriggerType : uint64_t { kTransmit = 1, kAck = 2 };

// Slots a message of `bytes` takes (an empty message still takes one).
inline uint32_t chunksFor(uint64_t bytes, uint32_t chunk) {
  return bytes == 0 ? 1u : static_cast<uint32_t>((bytes + chunk - 1) / chunk);
}

class WaiterCount;

class Engine {
 public:
  Engine(int rank, int nranks, const Config& cfg, const InboxLayout& layout, unsigned char* inbox,
         Transport* transport, std::vector<PeerInfo> peers, std::vector<bool> proxied,
         TriggerFifo* fifo, uint64_t timeout_ns);
  ~Engine();

  // Starting an op: begin() locks the engine and returns a blank op (waiting for a free one
  // if all are in flight); the caller fills it in and commit() reserves its channel
  // sequences, activates it and unlocks.
  Op* begin();
  OpHandle commit(Op* op);
  void abandon(Op* op);  // unlock without starting (argument error found while filling)

  // Non-blocking; true if the op finished (successfully or not).
  bool test(OpHandle h);
  // No longer in flight (finished, or superseded); no progress pass.
  static bool finished(OpHandle h) {
    return superseded(h) || h.op->state.load(std::memory_order_acquire) != OpState::kActive;
  }
  // The handle's op was released and its slot has started another op since.
  static bool superseded(OpHandle h) {
    return h.op->generation.load(std::memory_order_acquire) != h.generation;
  }
  // Drives progress until the op finishes; throws its error. timeout_ns 0: op's deadline.
  void wait(OpHandle h, uint64_t timeout_ns = 0);
  // The op's storage may be reused once it finished.
  void release(OpHandle h);
  // Called once (from the engine's driver) when the op finishes; used for futures.
  void setCompletionCallback(OpHandle h, void (*fn)(void*), void* ctx);

  // One progress pass if nobody else is driving; returns true if anything moved. `ran`: set
  // when this call did run the pass.
  bool tryProgress(bool* ran = nullptr);
  bool hasActive() const { return active_count_.load(std::memory_order_acquire) > 0; }
  bool hasWaiters() const { return waiters_.load(std::memory_order_acquire) > 0; }
  // The proxy side of a trigger.
  void handleTrigger(const Trigger& t);
  // A pass of the proxy's work (the trigger FIFO, the network transports) that wait() runs
  // itself between its progress passes, so that a blocking op needs no hand-off to the proxy
  // thread; returns true if it moved anything. Set once, before the first op.
  void setAssist(bool (*fn)(void*), void* ctx) {
    assist_ = fn;
    assist_ctx_ = ctx;
  }
  // How long a waiting thread polls hot before it yields its core (RESIDENT_SPIN_US unless the
  // owner chose otherwise for the host). Set once, before the first op.
  void setWaitSpinUs(uint64_t us) { spin_ns_ = us * 1000; }
  // Called when the last thread waiting on this engine's ops leaves wait() (or begin()): the
  // proxy, standing by while it drove the transport, may have to take over. Set once, before the
  // first op.
  void setWaitersGone(void (*fn)(void*), void* ctx) {
    waiters_gone_ = fn;
    waiters_gone_ctx_ = ctx;
  }
  // Called by begin() while every op of the pool is taken: the owner of the handles releases
  // those of finished ops (the c10d adapter's works). Set once, before the first op.
  void setReclaim(void (*fn)(void*), void* ctx) {
    reclaim_ = fn;
    reclaim_ctx_ = ctx;
  }

  // Fails every active op and refuses new ones; `kind`: kTimeout when the group gave up waiting.
  void poison(const std::string& reason, ErrorKind kind = ErrorKind::kComm);
  // A peer is gone: it left in order (destroyed its group), or `failed` (it died, or its group
  // failed). An op that still needs something from or for it fails with `why` (and with it the
  // group); ops that got all they needed from it finish. Proxy pass only; the first reason sticks.
  void markPeerLost(int peer, const std::string& why, bool failed);
  // Some peer died or its group failed (the CUDA path then aborts its kernels: the host cannot
  // tell which peer a running kernel waits for).
  bool anyPeerFailed() const { return any_failed_.load(std::memory_order_acquire); }
  // Why the first peer that failed is gone (empty if none did). Any thread.
  std::string firstPeerFailure() const;
  // The first peer that left in order while an op still needed it (the group then failed), so
  // that the peers told of the failure learn its cause; -1 if none. Any thread.
  void noteLeftPeerNeeded(int peer) {
    int none = -1;
    left_peer_needed_.compare_exchange_strong(none, peer);
  }
  int leftPeerNeeded() const { return left_peer_needed_.load(std::memory_order_acquire); }
  bool poisoned() const { return poisoned_.load(std::memory_order_acquire); }
  // What poisoned it: kTimeout or kComm (kNone while it is not). Any thread.
  ErrorKind poisonKind() const {
    return poisoned() ? poison_kind_.load(std::memory_order_relaxed) : ErrorKind::kNone;
  }
  // Why the group was poisoned (empty while it is not). Any thread.
  std::string poisonReason() const;
  uint64_t timeoutNs() const { return timeout_ns_; }
  void setTimeoutNs(uint64_t ns) { timeout_ns_ = ns; }
  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  uint64_t nextCollectiveSeq() { return coll_seq_++; }
  uint32_t chunkBytes() const { return layout_.slotBytes(); }

 private:
  void lock();
  bool tryLock();
  void unlock();
  bool progressLocked();
  bool progressOp(Op& op);
  bool progressSends(Op& op);
  bool progressPlaceRecvs(Op& op);
  bool progressReduce(Op& op);
  bool progressP2PRecvs();
  bool opFinished(const Op& op) const;
  void finishOp(Op& op, OpState state, ErrorKind kind, const std::string& error);
  void failAllLocked(const std::string& reason, ErrorKind kind);
  void checkDeadline(Op& op, uint64_t now);
  // Every chunk op still has to receive from peer p is in this rank's inbox already.
  bool restArrived(const Op& op, int p);
  void runCallbacks();

  const SlotHeader* readySlot(RecvChannel& ch, uint64_t seq) const;
  void validate(const Op& op, const SlotHeader& h, int peer, uint32_t chunk,
                uint64_t expected_bytes) const;
  void postChunk(SendChannel& ch, const Op& op, const unsigned char* src, uint64_t total,
                 uint32_t chunk);
  void consumeChunk(RecvChannel& ch);
  void transmit(SendChannel& ch, uint64_t seq);
  SendChannel& sendCh(int peer, Ring ring) { return send_[peer * kRings + ring]; }
  RecvChannel& recvCh(int peer, Ring ring) { return recv_[peer * kRings + ring]; }

  // P2P messages that arrived before a matching recv was posted.
  struct Stash {
    int peer;
    uint64_t tag;
    uint64_t total;
    uint32_t chunks, received;
    std::vector<unsigned char> data;
  };
  struct P2PBinding {
    Op* op = nullptr;        // bound recv op, or
    Stash* stash = nullptr;  // bound stash entry
  };
  bool deliverFromStash(Op& op);
  // A recv from any source takes `peer` as its sender once a message from it is matched.
  void bindAnySource(Op& op, int peer);

  const int rank_, nranks_;
  const Config cfg_;
  const InboxLayout layout_;
  unsigned char* const inbox_;
  Transport* const transport_;
  std::vector<PeerInfo> peers_;
  TriggerFifo* const fifo_;
  uint64_t timeout_ns_;
  uint64_t spin_ns_;  // setWaitSpinUs

  std::atomic_flag lock_ = ATOMIC_FLAG_INIT;
  std::vector<std::unique_ptr<Op>> pool_;
  std::vector<Op*> free_;
  std::vector<Op*> active_;  // submission order
  std::atomic<int> active_count_{0};
  std::atomic<int> waiters_{0};  // threads inside wait(), driving progress themselves
  std::vector<SendChannel> send_;
  std::vector<RecvChannel> recv_;
  std::vector<P2PBinding> p2p_bind_;
  std::vector<std::unique_ptr<Stash>> stash_;
  // Completion callbacks of finished ops, run after unlock.
  std::vector<std::pair<void (*)(void*), void*>> callbacks_;
  std::atomic<bool> has_callbacks_{false};
  uint64_t coll_seq_ = 0;
  bool (*assist_)(void*) = nullptr;
  void* assist_ctx_ = nullptr;
  void (*reclaim_)(void*) = nullptr;
  void* reclaim_ctx_ = nullptr;
  void (*waiters_gone_)(void*) = nullptr;
  void* waiters_gone_ctx_ = nullptr;
  friend class WaiterCount;
  std::atomic<bool> poisoned_{false};
  std::atomic<ErrorKind> poison_kind_{ErrorKind::kNone};  // stored before poisoned_
  mutable std::mutex poison_mu_;
  std::string poison_reason_;  // set once, under poison_mu_, before poisoned_
  std::string first_failure_;  // under poison_mu_
  // Per peer, set once by markPeerLost: kPresent, kLeft (destroyed its group in order) or
  // kFailed (its group failed, or it exited without destroying it).
  enum Lost : uint8_t { kPresent, kLeft, kFailed };
  std::unique_ptr<std::atomic<uint8_t>[]> lost_;
  std::atomic<bool> any_failed_{false};
  std::atomic<int> left_peer_needed_{-1};
  std::vector<std::string> lost_why_;
};

}  // namespace resident
