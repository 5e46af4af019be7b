// An operation in flight: what it sends to and receives from each peer, and how far it got.
// Ops live in a pool allocated once per communicator; starting an op only fills one in.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/layout.hpp"

namespace resident {

enum class OpKind : uint8_t {
  kAllReduce = 1,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kBroadcast,
  kReduce,
  kGather,
  kScatter,
  kBarrier,
  kSend,
  kRecv,
};
const char* opKindName(OpKind kind);

// kind, dtype and reduce op in one word, carried by every message so that a receiver can tell
// when its peer is running a different operation.
inline uint32_t opSignature(OpKind kind, DType dtype, RedOp op) {
  return (static_cast<uint32_t>(kind) << 16) | (static_cast<uint32_t>(dtype) << 8) |
         static_cast<uint32_t>(op);
}
std::string describeSignature(uint32_t signature);

enum class OpState : uint8_t { kFree, kActive, kDone, kFailed };
enum class ErrorKind : uint8_t { kNone, kComm, kTimeout };

struct PeerTransfer {
  bool sends = false;
  const unsigned char* send_ptr = nullptr;
  uint64_t send_bytes = 0;
  uint32_t send_chunks = 0;
  uint32_t sent = 0;
  uint64_t send_first = 0;  // ring sequence of this op's first chunk to the peer

  bool recvs = false;
  unsigned char* recv_ptr = nullptr;
  uint64_t recv_bytes = 0;
  uint32_t recv_chunks = 0;
  uint32_t received = 0;
  uint64_t recv_first = 0;
};

struct Op {
  // What.
  OpKind kind = OpKind::kBarrier;
  Ring ring = kCollectiveRing;
  DType dtype = DType::kBytes;
  RedOp redop = RedOp::kNone;
  uint64_t seq = 0;  // collective sequence number, or the tag of a send/recv
  int peer = -1;     // send/recv peer
  uint64_t bytes = 0;
  std::vector<PeerTransfer> peers;  // indexed by rank, sized once

  // Reduce mode: chunk k of the output is the rank-ordered reduction of every receiving
  // peer's chunk k and `reduce_local`'s chunk k; chunks advance in lockstep.
  bool reduce = false;
  const unsigned char* reduce_local = nullptr;
  unsigned char* reduce_out = nullptr;
  uint64_t reduce_bytes = 0;
  uint32_t reduce_chunks = 0;
  uint32_t reduced = 0;
  std::vector<const void*> reduce_inputs;  // scratch, sized once

  // Bookkeeping.
  std::atomic<OpState> state{OpState::kFree};
  ErrorKind error_kind = ErrorKind::kNone;
  std::string error;
  uint64_t start_ns = 0;
  uint64_t deadline_ns = 0;
  uint64_t last_liveness_check_ns = 0;
  // Bumped each time the slot starts an op; a handle of an earlier one no longer matches (a
  // waiter may read it while another thread restarts the slot).
  std::atomic<uint64_t> generation{0};  // 64 bits: never wraps within a process
  bool released = false;
  bool bound = false;  // recv: a message has been matched to it
  // recv from any source: `peer` is -1 and the buffer waits here until a message binds the
  // op to its sender (Engine::bindAnySource), which sets `peer` and that peer's transfer.
  bool any_source = false;
  unsigned char* any_source_buf = nullptr;
  int waiting_on = -1;
  void (*on_done)(void*) = nullptr;
  void* on_done_ctx = nullptr;

  uint32_t signature() const { return opSignature(kind, dtype, redop); }
  std::string describe() const;
};

struct OpHandle {
  Op* op = nullptr;
  uint64_t generation = 0;
};

}  // namespace resident
