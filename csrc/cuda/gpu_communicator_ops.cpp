// How each op of the CUDA path becomes one kernel launch on the caller's stream: the op's
// partners and byte counts into the reused CollectiveArgs (begin, partner), the block count and
// protocol choices (blocksFor, fenceTriggers), and the launch itself (launchCollective,
// launchP2P).
// Set-up, shutdown and status are in gpu_communicator.cpp; the proxy side in
// gpu_communicator_proxy.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "collective_launch.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "cuda/cuda_guards.hpp"
#include "cuda/gpu_communicator.hpp"
#include "rounds_device.cuh"

namespace resident {
namespace {

static_assert(static_cast<int>(DType::kUInt8) == 6 && static_cast<int>(DType::kInt8) == 7 &&
                  static_cast<int>(RedOp::kBXor) == 7,
              "kernels/reduce_device.cuh mirrors the DType and RedOp codes");

}  // namespace

// A type the kernels do not reduce is stopped here rather than reduced as uint8.
void GpuCommunicator::checkReduction(DType dtype, RedOp op, const char* what) const {
  comm_.checkReduction(dtype, op, what);
  if (!deviceReduces(dtype)) {
    throw InvalidArgument(std::string("resident: ") + what + " of CUDA tensors does not support " +
                          dtypeName(dtype) + " (CPU tensors do)");
  }
}

uint32_t GpuCommunicator::roundsFor(size_t bytes) const {
  return roundsFor(bytes, region_.chunk);
}

uint32_t GpuCommunicator::roundsFor(size_t bytes, uint32_t chunk) {
  const uint64_t r = gpu::roundsOfBytes(bytes, chunk);
  if (r > 0xffffffffull) throw InvalidArgument("resident: message too large");
  return static_cast<uint32_t>(r);
}

namespace {
// Parts of a first round (at most a chunk: fits 32 bits).
uint32_t partsOf(uint64_t first_round_bytes) {
  return gpu::partsOf(static_cast<uint32_t>(first_round_bytes));
}
// Parts per block over `blocks` blocks (never zero: blocksFor's count is at least one; the
// guard keeps a broken count from dividing by zero).
uint32_t partsFor(uint64_t first_round_bytes, uint32_t blocks) {
  blocks = std::max(blocks, 1u);
  return (partsOf(first_round_bytes) + blocks - 1) / blocks;
}
}  // namespace

// One block per 2 KiB part of the first (largest) round, within the residency budget.
uint32_t GpuCommunicator::blocksFor(uint64_t first_round_bytes) const {
  const uint32_t parts = partsOf(first_round_bytes);
  return parts < max_blocks_ ? parts : max_blocks_;
}

// Checked triggers pay off for small ops (the proxy starts on the lines while they land); from
// kFenceFromBytes (64 KiB, a full chunk) bytes per peer and round those ops fence on the device.
// With the proxy checking and copying a line in one pass, unfenced rounds of 32 KiB per peer
// read 5-22% faster than fenced ones in both repetitions of one run (H200, the bench-ab stage of
// scripts/device_run.sh with fence thresholds as backends); at 64 KiB per peer the two were
// within 4%, and with a separate check and copy unfenced was 31% slower there.
uint32_t GpuCommunicator::fenceTriggers(uint64_t first_round_bytes) const {
  return first_round_bytes >= kFenceFromBytes ? 1u : 0u;
}

gpu::Region GpuCommunicator::opRegion() const {
  gpu::Region r = region_;
  r.timeout_ns = timeout_ns_.load(std::memory_order_relaxed);
  return r;
}

gpu::CollectiveArgs& GpuCommunicator::begin(OpId op) {
  checkUsable();
  gpu::CollectiveArgs& a = args_;
  a.reg = opRegion();
  a.local_in = nullptr;
  a.out = nullptr;
  a.rank = rank_;
  a.nranks = nranks_;
  a.mode = static_cast<uint8_t>(gpu::Mode::kCopy);
  a.dtype = 0;
  a.redop = 0;
  a.op_id = op;
  for (int p = 0; p < nranks_; ++p) a.peers[p] = gpu::PeerPlan{};
  return a;
}

// Declares p a partner of this op (p == rank: the local copy/contribution).
void GpuCommunicator::partner(int p, const void* send, size_t send_bytes, void* recv,
                              size_t recv_bytes) {
  gpu::PeerPlan& pp = args_.peers[p];
  pp.send = send;
  pp.recv = recv;
  pp.send_bytes = send_bytes;
  pp.recv_bytes = recv_bytes;
  pp.rounds = roundsFor(send_bytes > recv_bytes ? send_bytes : recv_bytes);
}

void GpuCommunicator::logRounds(const gpu::CollectiveArgs& a) {
  // The rounds the host expects each pair to be at when this op starts, counted from when
  // tracing began (eager launches; a graph advances the device's counters on every replay
  // without the host): ranks whose lines disagree about a pair show the op that set them apart.
  // Only while tracing: an op's launch does no bookkeeping for the log otherwise.
  if (logLevel() < LogLevel::kTrace) return;
  std::string s;
  for (int p = 0; p < nranks_; ++p) {
    const uint32_t n = a.peers[p].rounds;
    if (p == rank_ || n == 0) continue;
    const uint64_t before = host_rounds_[p].fetch_add(n, std::memory_order_relaxed);
    s += " " + std::to_string(p) + ":" + std::to_string(before) + "+" + std::to_string(n);
  }
  RLOG_TRACE("rank %d of %d: CUDA %s, rounds with peers (peer:before+this op)%s", rank_, nranks_,
             opName(a.op_id), s.c_str());
}

void GpuCommunicator::launchCollective(void* stream) {
  gpu::CollectiveArgs& a = args_;
  uint32_t rounds_max = 0;
  uint64_t first_round_max = 0;
  bool any_simple = false;      // a partner exchanges this op with the simple protocol
  bool simple_proxied = false;  // ... and is reached through the proxy
  for (int p = 0; p < nranks_; ++p) {
    const gpu::PeerPlan& pp = a.peers[p];
    if (pp.rounds == 0) continue;
    rounds_max = pp.rounds > rounds_max ? pp.rounds : rounds_max;
    const uint64_t b = pp.send_bytes > pp.recv_bytes ? pp.send_bytes : pp.recv_bytes;
    const uint64_t first = b < region_.chunk ? b : region_.chunk;
    first_round_max = first > first_round_max ? first : first_round_max;
    const bool simple = p != rank_ && gpu::simplePair(a.reg, p, static_cast<uint32_t>(first));
    any_simple |= simple;
    simple_proxied |= simple && ((a.reg.proxied >> p) & 1u) != 0;
  }
  if (rounds_max == 0) return;  // nothing to exchange with anyone (e.g. a group of one)
  logRounds(a);
  // The same bytes to every partner? Then their first word can be loaded at kernel start.
  a.common_send = nullptr;
  a.common_send_bytes = 0;
  const gpu::PeerPlan* first = nullptr;
  bool same = true;
  for (int p = 0; p < nranks_ && same; ++p) {
    const gpu::PeerPlan& pp = a.peers[p];
    if (p == rank_ || pp.rounds == 0) continue;
    if (first == nullptr) first = &pp;
    same = pp.send == first->send && pp.send_bytes == first->send_bytes;
  }
  if (same && first != nullptr && first->send != nullptr && first->send_bytes > 0) {
    a.common_send = first->send;
    a.common_send_bytes = first->send_bytes;
  }
  a.rounds_max = rounds_max;
  a.reg.trigger_fence = fenceTriggers(first_round_max);
  a.reg.simple = any_simple ? 1u : 0u;  // the kernel built with the simple protocol, if needed
  // One round with every partner, a block per 2 KiB part within the block budget: the
  // one-round kernel, a thread per line (fewer threads for an op of one part); with the simple
  // protocol for direct partners (its build with Region::simple), not for proxied ones, whose
  // payload and flags go as triggers (the general kernel's pushSimpleRound).
  const uint32_t parts = partsOf(first_round_max);
  if (rounds_max == 1 && parts <= max_blocks_ && !simple_proxied) {
    // Lines of part 0 (a whole part when there are several), at least the one credit line.
    const uint32_t lines = gpu::payloadLines(static_cast<uint32_t>(first_round_max), 0);
    const unsigned threads = ((lines ? lines : 1u) + 31) / 32 * 32;
    a.parts_per_block = 1;
    checkCuda(gpu::launchOneRound(a, parts, threads, static_cast<cudaStream_t>(stream)),
              "launching the one-round collective kernel");
    return;
  }
  const uint32_t blocks = blocksFor(first_round_max);
  a.parts_per_block = partsFor(first_round_max, blocks);
  checkCuda(gpu::launchCollective(a, blocks, static_cast<cudaStream_t>(stream)),
            "launching the collective kernel");
}

void GpuCommunicator::allReduce(const void* in, void* out, size_t count, DType dtype, RedOp op,
                                void* stream) {
  checkReduction(dtype, op, "all_reduce");
  auto& a = begin(kAllReduce);
  const size_t bytes = count * dtypeSize(dtype);
  for (int p = 0; p < nranks_; ++p) partner(p, in, bytes, p == rank_ ? out : nullptr, bytes);
  a.mode = static_cast<uint8_t>(gpu::Mode::kReduce);
  a.dtype = static_cast<uint8_t>(dtype);
  a.redop = static_cast<uint8_t>(op);
  a.local_in = in;
  a.out = out;
  launchCollective(stream);
}

void GpuCommunicator::reduceScatter(const void* in, void* out, size_t count, DType dtype, RedOp op,
                                    void* stream) {
  std::array<const void*, gpu::kMaxRanks> inputs;  // no allocation per op
  const size_t bytes = count * dtypeSize(dtype);
  for (int p = 0; p < nranks_; ++p)
    inputs[static_cast<size_t>(p)] = static_cast<const unsigned char*>(in) + p * bytes;
  reduceScatterV(inputs.data(), out, count, dtype, op, stream);
}

void GpuCommunicator::reduceScatterV(const void* const* inputs, void* out, size_t count,
                                     DType dtype, RedOp op, void* stream) {
  checkReduction(dtype, op, "reduce_scatter");
  auto& a = begin(kReduceScatter);
  const size_t bytes = count * dtypeSize(dtype);
  for (int p = 0; p < nranks_; ++p) partner(p, inputs[p], bytes, p == rank_ ? out : nullptr, bytes);
  a.mode = static_cast<uint8_t>(gpu::Mode::kReduce);
  a.dtype = static_cast<uint8_t>(dtype);
  a.redop = static_cast<uint8_t>(op);
  a.local_in = inputs[rank_];
  a.out = out;
  launchCollective(stream);
}

void GpuCommunicator::reduce(const void* in, void* out, size_t count, DType dtype, RedOp op,
                             int root, void* stream) {
  checkReduction(dtype, op, "reduce");
  comm_.checkRank(root, "reduce");
  auto& a = begin(kReduce);
  const size_t bytes = count * dtypeSize(dtype);
  if (rank_ == root) {
    for (int p = 0; p < nranks_; ++p)
      partner(p, p == rank_ ? in : nullptr, p == rank_ ? bytes : 0, p == rank_ ? out : nullptr,
              bytes);
    a.mode = static_cast<uint8_t>(gpu::Mode::kReduce);
    a.dtype = static_cast<uint8_t>(dtype);
    a.redop = static_cast<uint8_t>(op);
    a.local_in = in;
    a.out = out;
  } else {
    partner(root, in, bytes, nullptr, 0);
  }
  launchCollective(stream);
}

void GpuCommunicator::allGather(const void* in, void* const* outs, size_t bytes, void* stream) {
  begin(kAllGather);
  for (int p = 0; p < nranks_; ++p) partner(p, in, bytes, outs[p], bytes);
  launchCollective(stream);
}

void GpuCommunicator::gather(const void* in, void* const* outs, size_t bytes, int root,
                             void* stream) {
  comm_.checkRank(root, "gather");
  begin(kGather);
  if (rank_ == root) {
    for (int p = 0; p < nranks_; ++p)
      partner(p, p == rank_ ? in : nullptr, p == rank_ ? bytes : 0, outs[p], bytes);
  } else {
    partner(root, in, bytes, nullptr, 0);
  }
  launchCollective(stream);
}

void GpuCommunicator::scatter(const void* const* ins, void* out, size_t bytes, int root,
                              void* stream) {
  comm_.checkRank(root, "scatter");
  begin(kScatter);
  if (rank_ == root) {
    for (int p = 0; p < nranks_; ++p)
      partner(p, ins[p], bytes, p == rank_ ? out : nullptr, p == rank_ ? bytes : 0);
  } else {
    partner(root, nullptr, 0, out, bytes);
  }
  launchCollective(stream);
}

void GpuCommunicator::allToAll(const void* const* ins, const size_t* in_bytes, void* const* outs,
                               const size_t* out_bytes, void* stream) {
  if (in_bytes[rank_] != out_bytes[rank_]) {
    throw InvalidArgument("resident: all_to_all: this rank sends itself " +
                          std::to_string(in_bytes[rank_]) + " bytes but expects " +
                          std::to_string(out_bytes[rank_]) + " from itself (split mismatch)");
  }
  begin(kAllToAll);
  for (int p = 0; p < nranks_; ++p) partner(p, ins[p], in_bytes[p], outs[p], out_bytes[p]);
  launchCollective(stream);
}

void GpuCommunicator::allToAllDeviceSplits(const void* send, void* recv, size_t max_rows,
                                           size_t row_bytes, const void* send_rows,
                                           const void* recv_rows, uint32_t count_bytes,
                                           uint32_t per_peer, bool counts_out, void* stream) {
  if (count_bytes != 4 && count_bytes != 8)
    throw InvalidArgument("resident: all_to_all_device_splits: counts must be int32 or int64");
  if (per_peer == 0)
    throw InvalidArgument("resident: all_to_all_device_splits: no counts per peer");
  // The header of a message with its counts: within the first part of a round (of half a
  // chunk, below).
  const uint64_t header = counts_out ? (uint64_t{per_peer} * count_bytes + 7) / 8 * 8 : 0;
  const uint64_t header_max = std::min<uint64_t>(gpu::kPartPayload, region_.chunk / 2);
  if (header > header_max)
    throw InvalidArgument("resident: all_to_all_device_splits: counts_out takes at most " +
                          std::to_string(header_max) + " bytes of counts per peer (" +
                          std::to_string(per_peer) + " of " + std::to_string(count_bytes) +
                          " bytes given)");
  const uint64_t cap = static_cast<uint64_t>(max_rows) * row_bytes;
  auto& a = begin(kAllToAllDeviceSplits);
  if (cap == 0 && header == 0) return;
  // The capacity plan: the pointers stay, the kernel puts the counts' bytes and rounds in.
  for (int p = 0; p < nranks_; ++p)
    partner(p, static_cast<const unsigned char*>(send) + p * cap, header + cap,
            static_cast<unsigned char*>(recv) + p * cap, header + cap);
  // Counts in the header: LL lines only (a pair's protocol is known only with its counts), in
  // rounds of half a chunk, so that the lines stay in the half of a slot that holds only lines
  // and flags: the other half keeps the payload of the pair's last simple op, whose bytes could
  // read as lines of this round (kernels/simple_device.cuh).
  if (header != 0) a.reg.chunk = region_.chunk / 2;
  const uint32_t chunk = a.reg.chunk;
  const uint64_t first = header + cap < chunk ? header + cap : chunk;
  // The simple build when any pair could go simple at some count (simplePair grows with the
  // bytes, so the capacity decides); it runs LL pairs as well.
  bool any_simple = false;
  for (int p = 0; p < nranks_ && header == 0; ++p)
    any_simple |= p != rank_ && gpu::simplePair(a.reg, p, static_cast<uint32_t>(first));
  a.common_send = nullptr;
  a.common_send_bytes = 0;
  a.rounds_max = roundsFor(header + cap, chunk);
  a.reg.simple = any_simple ? 1u : 0u;
  a.reg.trigger_fence = fenceTriggers(first);  // replaced on the device from the counts
  const uint32_t want = blocksFor(first);
  const uint32_t blocks = want < split_max_blocks_ ? want : split_max_blocks_;
  a.parts_per_block = partsFor(first, blocks);
  // Not logRounds: the rounds with each peer are known only on the device.
  RLOG_TRACE(
      "rank %d of %d: CUDA %s: rounds with each peer from the device's counts (the host's "
      "count of rounds no longer follows the device's after this op)",
      rank_, nranks_, opName(a.op_id));
  gpu::SplitsArgs s{};
  s.coll = a;
  s.send_rows = send_rows;
  s.recv_rows = recv_rows;
  s.row_bytes = row_bytes;
  s.max_rows = max_rows;
  s.count_bytes = count_bytes;
  s.per_peer = per_peer;
  s.fence_from_bytes = static_cast<uint32_t>(kFenceFromBytes);
  s.header_bytes = static_cast<uint32_t>(header);
  checkCuda(gpu::launchSplits(s, blocks, static_cast<cudaStream_t>(stream)),
            "launching the device-splits all_to_all kernel");
}

void GpuCommunicator::broadcast(void* buf, size_t bytes, int root, void* stream) {
  comm_.checkRank(root, "broadcast");
  begin(kBroadcast);
  if (rank_ == root) {
    for (int p = 0; p < nranks_; ++p)
      if (p != rank_) partner(p, buf, bytes, nullptr, 0);
  } else {
    partner(root, nullptr, 0, buf, bytes);
  }
  launchCollective(stream);
}

void GpuCommunicator::launchP2P(bool is_send, const void* src, void* dst, size_t bytes, int peer,
                                void* stream) {
  checkUsable();
  comm_.checkRank(peer, is_send ? "send" : "recv");
  if (peer == rank_)
    throw InvalidArgument(std::string("resident: ") + (is_send ? "send to" : "recv from") +
                          " this rank itself is not supported");
  gpu::P2PArgs a{};
  a.reg = opRegion();
  a.send = src;
  a.recv = dst;
  a.bytes = bytes;
  a.rank = rank_;
  a.peer = peer;
  a.rounds = roundsFor(bytes);
  a.op_id = is_send ? kSend : kRecv;
  const size_t first = bytes < region_.chunk ? bytes : region_.chunk;
  a.reg.trigger_fence = fenceTriggers(first);
  // p2p kernels of every peer and direction may be resident at once (each direction has its
  // own stream, each with a PDL successor): together they get what one collective gets.
  const uint32_t streams = 2u * static_cast<uint32_t>(nranks_ > 1 ? nranks_ - 1 : 1);
  const uint32_t cap = max_blocks_ / streams > 0 ? max_blocks_ / streams : 1;
  const uint32_t want = blocksFor(first);
  const uint32_t blocks = want < cap ? want : cap;
  a.parts_per_block = partsFor(first, blocks);
  auto s = static_cast<cudaStream_t>(stream);
  checkCuda(is_send ? gpu::launchSend(a, blocks, s) : gpu::launchRecv(a, blocks, s),
            is_send ? "launching the send kernel" : "launching the recv kernel");
}

void GpuCommunicator::send(const void* buf, size_t bytes, int peer, void* stream) {
  launchP2P(true, buf, nullptr, bytes, peer, stream);
}

void GpuCommunicator::recv(void* buf, size_t bytes, int peer, void* stream) {
  launchP2P(false, nullptr, buf, bytes, peer, stream);
}

}  // namespace resident
