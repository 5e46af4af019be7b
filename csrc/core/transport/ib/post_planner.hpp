// The posting policy of the ib transport, as pure logic: turns the writes the proxy issued during
// one pass — (peer, remote offset, bytes, is_signal) with their staged local bytes — into one
// chain of work requests per peer, and keeps every send queue within its depth.
//
//  * Batching: a peer's writes become one chained post, in issue order. A write that continues
//    the previous one in remote memory joins its work request (another SGE, or a longer SGE when
//    the local bytes are contiguous too), up to max_sge.
//  * Inline: a work request of at most max_inline bytes is posted inline (the HCA copies the bytes
//    at post time: no DMA read of the local buffer on the critical path).
//  * Selective signalling: every signal_every-th work request is signalled, and so is any request
//    that fills the send queue, so that a completion always comes to make room, and any request
//    whose tag is signal_tag_span past the last signalled one's (the caller's tags are staging
//    positions, and staging comes back only with completions: this bounds what unsignalled
//    requests may hold, so a full staging ring always has a completion on its way). A completion of
//    a signalled request retires it and every earlier one of its queue pair (RC completes in
//    order). Requests that would overflow the queue are not planned: they come back deferred.
//  * Completion (how the peer learns the data is there), CompletionMode:
//      kFlagInLine   - the 8-byte flag rides in the same RDMA write as the bytes before it when it
//                      is their continuation (LL lines, a trailing flag); otherwise as kFlagWrite.
//      kFlagWrite    - the flag is a separate small RDMA write after the payload, fenced when
//                      fence_flag_writes (the fence orders it behind earlier reads/atomics too; RC
//                      places the writes of one queue pair in order).
//      kWriteWithImm - the signal is an RDMA write with immediate of a 16-byte record {offset,
//                      value} into the peer's landing ring; the immediate is the ring slot. The
//                      peer's proxy sees the receive completion — proof that everything before it
//                      on the queue pair has landed — and stores the flag itself with release
//                      semantics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/transport/ib/verbs_abi.hpp"

namespace resident {
namespace ib {

enum class CompletionMode : uint8_t { kFlagInLine, kFlagWrite, kWriteWithImm };
const char* completionModeName(CompletionMode mode);

// A landing-ring record (kWriteWithImm): where the flag goes in the receiver's inbox, and its
// value.
struct LandingRecord {
  uint64_t offset;
  uint64_t value;
};
constexpr uint32_t kLandingRecordBytes = sizeof(LandingRecord);
constexpr uint32_t kFlagBytes = 8;

struct PlannerConfig {
  uint32_t max_inline = 0;       // the QP's max_inline_data
  uint32_t max_sge = 1;          // SGEs per work request
  uint32_t sq_depth = 128;       // work requests the send queue holds
  uint32_t signal_every = 16;    // signal at least every Nth work request
  uint64_t signal_tag_span = 0;  // ...and once tags ran this far past the last signalled (0: off)
  CompletionMode mode = CompletionMode::kFlagInLine;
  bool fence_flag_writes = true;
  uint32_t imm_slots = 0;  // landing ring entries per peer (kWriteWithImm)
};

struct WriteReq {
  int peer = 0;
  uint64_t offset = 0;  // in the peer's inbox (data, or the flag word for a signal)
  uint32_t bytes = 0;   // data: any; signal: kFlagBytes, or kLandingRecordBytes (kWriteWithImm)
  bool is_signal = false;
  uint64_t local_addr = 0;  // staged local bytes (a registered region)
  uint32_t lkey = 0;
  uint64_t tag = 0;  // caller's cookie, non-decreasing per peer (the staging position after it)
};

enum class WrTarget : uint8_t { kInbox, kLanding };

struct PlannedWr {
  uint64_t wr_id = 0;
  WrTarget target = WrTarget::kInbox;
  uint64_t remote_offset = 0;  // within the target region
  uint32_t bytes = 0;
  uint32_t first_sge = 0;  // into PeerBatch::sges
  uint32_t num_sge = 0;
  bool inline_data = false;
  bool signaled = false;
  bool fence = false;
  bool with_imm = false;
  bool carries_signal = false;  // ends with (or is) a flag
  uint32_t imm = 0;             // host order; the ring slot (kWriteWithImm)
  uint64_t tag = 0;             // largest request tag folded into this request
};

struct PeerBatch {
  int peer = -1;
  std::vector<PlannedWr> wrs;  // one chained post, in order
  std::vector<abi::Sge> sges;
};

class PostPlanner {
 public:
  PostPlanner(int npeers, const PlannerConfig& cfg);

  // Plans reqs[0..n) (any peers, issue order). Returns how many were planned. Requests of a peer
  // whose send queue is full are appended to *deferred in order (with every later request of that
  // peer) for the caller to offer again after completions. signal_last: also signal each batch's
  // last request (the caller wants its local buffers back). Storage is reused between calls.
  size_t plan(const WriteReq* reqs, size_t n, std::vector<WriteReq>* deferred,
              bool signal_last = false);
  // Peers with a batch from the last plan(), in order of first appearance, and their batches
  // (mutable: the SGE array is handed to ibv_post_send as is).
  const std::vector<int>& plannedPeers() const { return planned_peers_; }
  PeerBatch& batch(int peer) { return peers_[static_cast<size_t>(peer)].batch; }

  // A signalled request completed: it and every earlier request of its peer left the send queue.
  // Returns the largest tag among them. *peer receives the peer. Throws on an unknown wr_id.
  uint64_t complete(uint64_t wr_id, int* peer);

  uint32_t outstanding(int peer) const;  // posted and not yet retired
  bool idle(int peer) const { return outstanding(peer) == 0; }
  const PlannerConfig& config() const { return cfg_; }

  // wr_id layout: bit 63 set for receive requests; bits 48..62 the peer; bits 0..47 a sequence.
  static constexpr uint64_t kRecvBit = 1ull << 63;
  static uint64_t makeWrId(int peer, uint64_t seq, bool recv = false) {
    return (recv ? kRecvBit : 0) | (static_cast<uint64_t>(peer) & 0x7fff) << 48 |
           (seq & ((1ull << 48) - 1));
  }
  static int wrPeer(uint64_t wr_id) { return static_cast<int>((wr_id >> 48) & 0x7fff); }
  static uint64_t wrSeq(uint64_t wr_id) { return wr_id & ((1ull << 48) - 1); }
  static bool wrIsRecv(uint64_t wr_id) { return (wr_id & kRecvBit) != 0; }

 private:
  struct Signaled {
    uint64_t seq;
    uint64_t tag;
  };
  struct PeerState {
    uint64_t posted = 0;        // work requests planned so far (sequence of the next one)
    uint64_t retired = 0;       // work requests known complete
    uint32_t since_signal = 0;  // unsignalled requests since the last signalled one
    uint64_t signaled_tag = 0;  // largest tag covered by a signalled request
    uint64_t imm_next = 0;      // next landing slot (mod imm_slots)
    uint64_t tag_hi = 0;
    std::vector<Signaled> ring;  // signalled, not yet completed (capacity sq_depth)
    size_t ring_head = 0, ring_size = 0;
    PeerBatch batch;
  };
  // Appends req to its peer's batch; false if a new work request was needed and the queue is full.
  bool place(PeerState& ps, const WriteReq& req);
  PlannedWr* openWr(PeerState& ps, const WriteReq& req);
  bool tryMerge(PeerState& ps, const WriteReq& req);
  // After a request joined `wr`: signals wr when its tag ran signal_tag_span past the last
  // signalled one's, and keeps signaled_tag current.
  void checkTagSpan(PeerState& ps, PlannedWr& wr);

  const PlannerConfig cfg_;
  std::vector<PeerState> peers_;
  std::vector<int> planned_peers_;
  std::vector<uint8_t> blocked_;  // per peer, during one plan(): a request was deferred
};

}  // namespace ib
}  // namespace resident
