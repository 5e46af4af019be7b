// Arguments of the CUDA kernels, shared by the host launcher and the device code. Plain data:
// no torch, no CUDA types. A kernel's arguments are captured by value into a CUDA graph, so
// everything that must change between replays (sequence numbers, FIFO head) lives in
// DeviceState, in device memory, and advances on the device.
#pragma once

#include <cstdint>

namespace resident {
namespace gpu {

constexpr int kMaxRanks = 64;                    // per group on the CUDA path
constexpr int kThreads = 256;                    // threads per block; one LL line each per part
constexpr uint32_t kPartPayload = kThreads * 8;  // payload bytes of one part (2 KiB)
constexpr int kMaxBlocks = 64;

enum class Mode : uint8_t { kCopy = 0, kReduce = 1 };
// kPeerLeft: the peer waited for left the group (GpuLayout::kPeersLeftWord) before it came.
enum class ErrorCode : uint32_t { kNone = 0, kTimeout = 1, kAborted = 2, kPeerLeft = 3 };

// Per-peer state that persists across ops (device memory, zeroed at install).
struct DeviceState {
  uint32_t coll_round[kMaxRanks];      // collective rounds completed with each peer
  uint32_t p2p_send_round[kMaxRanks];  // p2p rounds sent to each peer
  uint32_t p2p_recv_round[kMaxRanks];  // p2p rounds received from each peer
  uint32_t p2p_credit[kMaxRanks][2];   // cached: last round each peer consumed, per slot
  uint32_t p2p_done[kMaxRanks][2];     // blocks done with a received round, by parity
  // Blocks of the running kernel that read its round numbers (the last advances them), one
  // counter per kind of kernel that may run concurrently with the others: collectives (one at
  // a time), and per peer a send and a recv (each point-to-point direction has its own stream).
  uint32_t coll_blocks_done;
  uint32_t send_blocks_done[kMaxRanks];
  uint32_t recv_blocks_done[kMaxRanks];
  uint32_t failed;  // a block gave up: the others stop polling
  // The device-splits all_to_all with counts in the header (splits_kernel.cu): the mark of the
  // op whose peers' counts block 0 has put in recv_rows, for the kernel's other blocks.
  uint32_t splits_header;
  unsigned long long fifo_head;        // trigger FIFO producer position
  unsigned long long fifo_tail_cache;  // last tail read from host memory
  unsigned char* remote[kMaxRanks];    // peer's GPU region mapped here (direct path) or null
};

struct PeerPlan {
  const void* send;  // bytes to send to this peer (device memory)
  void* recv;        // where bytes from this peer go (copy mode)
  uint64_t send_bytes;
  uint64_t recv_bytes;
  uint32_t rounds;  // rounds exchanged with this peer; 0: not a partner in this op
  uint32_t pad;
};

// Where a kernel finds the shared memory of the communicator.
struct Region {
  DeviceState* state;
  unsigned char* local;   // this rank's GPU region (device pointer of mapped host memory)
  unsigned char* outbox;  // staging for the proxy path (device pointer), or null
  uint64_t slot_bytes;    // bytes of lines per slot
  uint64_t coll_in0, p2p_in0, credit_in0;  // offsets of coll_in(0), p2p_in(0), credit_in(0)
  uint64_t out_stride;                     // outbox bytes per destination
  uint64_t out_p2p0, out_credit0;          // outbox offsets of outP2P(0), outCredit(0)
  uint32_t chunk;                          // payload bytes per round
  uint32_t fifo_mask;
  uint64_t fifo_offset;
  uint64_t timeout_ns;  // a wait longer than this reports a timeout and gives up
  uint64_t proxied;     // bit p: peer p is reached through the proxy (known before any load)
  // Per op (GpuCommunicator::fenceTriggers): nonzero fences every trigger on the device; zero
  // pushes triggers of LL lines unfenced and the proxy checks the lines' flags.
  uint32_t trigger_fence;
  // Per op: nonzero when a pair of the op exchanges it with the simple protocol (payload and one
  // flag per part instead of LL lines, simple_device.cuh), so that the kernel built with it runs.
  uint32_t simple;
  // simplePair's rule: a pair goes simple for an op whose first round's larger direction carries
  // more than simple_above[rule] bytes (kSimpleNever: never; zero, as in a zeroed Region: always),
  // where the rule (pairRule) is 0 for a pair direct both ways, 1 for a pair proxied in at least
  // one direction (bit p of proxy_rule) over shared memory, 2 for one over a network transport
  // (bit p of network_rule too: tcp, ib).
  uint32_t simple_above[3];
  uint64_t proxy_rule;
  uint64_t network_rule;
  // RESIDENT_GPU_PROXY_TRACE: the general collective kernel's timeline (kernel_stamps.cuh),
  // kStampOps x 2 blocks x kStampsPerBlock stamps in device memory; null: not recorded.
  unsigned long long* stamps;
};

// The general kernel's timeline: per op (its round number with the next rank, modulo
// kStampOps) and for thread 0 of its first and last block, %globaltimer (ns) at each
// StampPoint; zero where the op did not pass it.
constexpr uint32_t kStampOps = 4096;
constexpr uint32_t kStampsPerBlock = 5;
enum StampPoint : uint32_t {
  kStampWaited = 0,    // the previous kernel is done (griddepcontrol.wait returned)
  kStampSent = 1,      // round 0 written (direct) or stored and handed to the proxy
  kStampFlags = 2,     // reduce mode: round 0's flags or lines from every partner seen
  kStampReceived = 3,  // round 0 received (and reduced) into the output
  kStampExit = 4,      // the block is done with the op
};

constexpr uint32_t kSimpleNever = 0xffffffffu;

struct CollectiveArgs {
  Region reg;
  const void* local_in;  // reduce mode: this rank's contribution
  void* out;             // reduce mode: the result
  int32_t rank, nranks;
  uint8_t mode, dtype, redop, op_id;
  uint32_t rounds_max;
  uint32_t parts_per_block;
  // Non-null when every partner is sent the same bytes (all_reduce, all_gather, broadcast) and
  // RESIDENT_GPU_PREFETCH is on (the default): each thread loads its first payload word first
  // thing in the op's body, so that the load overlaps the trigger reservation and the first
  // barrier instead of following them.
  const void* common_send;
  uint64_t common_send_bytes;
  PeerPlan peers[kMaxRanks];
};

// An all_to_all whose per-peer byte counts are read on the device (splits_kernel.cu): `coll`
// holds the capacity plan (peer p's send and recv pointers at p * max_rows rows, rounds_max
// and the grid from the capacity); the kernel replaces each peer's send_bytes, recv_bytes and
// rounds with those of the counts before the first round, so that a captured graph moves, on
// every replay, only the rows its counts name. Both sides of a pair must see the same counts
// of the pair (send_rows[q] on p equals recv_rows[p] on q): their rounds follow from them.
struct SplitsArgs {
  CollectiveArgs coll;
  // [nranks][per_peer] counts (int32 or int64, device memory): a peer's rows are the sum of its
  // entries (per_peer 1: one count per peer; EP passes its per-(peer, expert) counts as they are)
  const void* send_rows;  // rows to send to each peer
  const void* recv_rows;  // rows to receive from each peer (the same type and shape)
  uint64_t row_bytes;
  uint64_t max_rows;     // capacity per peer: a peer's rows are clamped to [0, max_rows]
  uint32_t count_bytes;  // 4 (int32 counts) or 8 (int64)
  uint32_t per_peer;     // counts per peer (>= 1)
  // Region::trigger_fence is set on the device for the op's largest first round to one peer:
  // fenced from this many bytes on (GpuCommunicator::fenceTriggers' threshold).
  uint32_t fence_from_bytes;
  // 0: recv_rows is given. Else the counts travel with the rows: each message to peer q starts
  // with send_rows[q]'s entries, zero-padded to header_bytes (a multiple of 8, at most one part),
  // and recv_rows is written from the peers' headers (splits_kernel.cu; LL lines only).
  uint32_t header_bytes;
};

struct P2PArgs {
  Region reg;
  const void* send;  // send: source; recv: null
  void* recv;        // recv: destination; send: null
  uint64_t bytes;
  int32_t rank, peer;
  uint32_t rounds;
  uint32_t parts_per_block;
  uint8_t op_id;
};

}  // namespace gpu
}  // namespace resident
