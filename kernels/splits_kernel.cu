// all_to_all with per-peer row counts read on the device (SplitsArgs): the collective body
// (collective_body.cuh) on a plan built in shared memory from the counts at kernel start.
// A separate kernel, so that the ordinary collective kernel keeps reading its plan from the
// grid constants with its registers and timing unchanged.
#include <cuda_runtime.h>

#include "collective_body.cuh"
#include "collective_launch.hpp"
#include "launch_device.cuh"

namespace resident {
namespace gpu {
namespace {

static_assert(sizeof(CollectiveArgs) % 8 == 0, "CollectiveArgs is copied in 8-byte words");

// Entry i of an int32 or int64 counts array; `fresh`: written by another block of this kernel
// (loaded from L2).
__device__ __forceinline__ int64_t countAt(const void* counts, uint32_t count_bytes, uint32_t i,
                                           bool fresh) {
  if (count_bytes == 8) {
    const auto* c = static_cast<const long long*>(counts) + i;
    return fresh ? __ldcg(c) : *c;
  }
  const auto* c = static_cast<const int*>(counts) + i;
  return fresh ? __ldcg(c) : *c;
}

// Adds entry i of a counts array to its peer's sum (entries i / per_peer; negative entries count
// as 0).
__device__ __forceinline__ void addCount(unsigned long long* sums, const SplitsArgs& s,
                                         const void* counts, uint32_t i, bool fresh) {
  const int64_t v = countAt(counts, s.count_bytes, i, fresh);
  if (v > 0) atomicAdd(&sums[i / s.per_peer], static_cast<unsigned long long>(v));
}

// Clamps n sums to [0, max_rows] (a count past the capacity would run off the buffers; both
// sides of a pair clamp the same sum alike). Ends with a barrier.
__device__ __forceinline__ void clampRows(unsigned long long* sums, int n, uint64_t max_rows) {
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    sums[i] = sums[i] < max_rows ? sums[i] : max_rows;
  __syncthreads();
}

// Rows of each peer from the counts arrays, summed over the `per_peer` entries of each peer by
// every thread of the block at once, then clamped. `sums` ([2][kMaxRanks], shared) ends with the
// send and recv rows (the recv rows zero with the counts in the header).
__device__ __forceinline__ void sumRows(const SplitsArgs& s, int nranks, unsigned long long* sums) {
  for (int i = threadIdx.x; i < 2 * kMaxRanks; i += blockDim.x) sums[i] = 0;
  __syncthreads();
  const uint32_t n = static_cast<uint32_t>(nranks) * s.per_peer;
  // With the counts in the header, recv_rows is this op's output: its rows come from the peers.
  const uint32_t entries = s.header_bytes ? n : 2 * n;
  for (uint32_t i = threadIdx.x; i < entries; i += blockDim.x) {
    if (i < n)
      addCount(sums, s, s.send_rows, i, false);
    else
      addCount(sums + kMaxRanks, s, s.recv_rows, i - n, false);
  }
  clampRows(sums, 2 * kMaxRanks, s.max_rows);
}

// Counts in the header (SplitsArgs::header_bytes): each message to a peer is the peer's counts
// (zero-padded to header_bytes), then its rows; the peer learns its recv rows from the header
// instead of from an exchange before. LL lines only (a pair's protocol must be known before
// its counts), in rounds of half a chunk (the host halves the op's Region::chunk), so that they
// never reach a slot's simple payload half. Round 0 carries only payload lines (the header at
// least; no credit lines); block 0 of the receiver reads the headers and hands the counts to the
// other blocks (headerRows). Rounds 1.. follow the body's rules (exchangedParts covers every part
// either side wrote in round 0), and the next op reuses a slot only after this kernel's blocks have
// exited (it does not let the next kernel launch early).

// The counts header as the leading words of each message (collective_body.cuh): the 8 bytes
// at message offset o (< header_bytes) to peer p are its counts, then zeros.
struct CountsHeader {
  const SplitsArgs& s;
  __device__ bool covers(uint64_t o) const { return o < s.header_bytes; }
  __device__ uint64_t word(int p, uint64_t o) const {
    const uint32_t counts = s.per_peer * s.count_bytes;
    if (o >= counts) return 0;
    const auto* from =
        static_cast<const unsigned char*>(s.send_rows) + static_cast<uint64_t>(p) * counts + o;
    return loadBytes(from, counts - o < 8u ? static_cast<uint32_t>(counts - o) : 8u);
  }
};

// The peers' recv rows, into rows[kMaxRanks + p] (clamped to max_rows); false when the op gives
// up. Block 0 alone reads the headers (part 0 of round 0, which it receives itself), puts the
// counts in recv_rows and then the op's mark in DeviceState::splits_header; the other blocks wait
// for the mark and sum recv_rows. A block that read the header lines itself could still be at
// it when the peer, two rounds on, writes the slot again (it does so once this rank's block 0
// has passed round 1). Block-uniform.
__device__ inline bool headerRows(const CollectiveArgs& a, const SplitsArgs& s, Shared& sh,
                                  Waiter& w, unsigned long long* rows) {
  const uint32_t lines = s.header_bytes / 8;
  const uint32_t n = static_cast<uint32_t>(a.nranks);
  const uint32_t counts = s.per_peer * s.count_bytes;
  auto* recv_rows = static_cast<unsigned char*>(const_cast<void*>(s.recv_rows));
  // Unique per op: the next op's first generation with a partner is past this one's.
  const int ref = a.rank + 1 < a.nranks ? a.rank + 1 : 0;
  const uint32_t mark = sh.base[ref] + 1;
  auto* ready = reinterpret_cast<volatile uint32_t*>(&a.reg.state->splits_header);
  bool ok = true;
  if (blockIdx.x == 0) {
    for (uint32_t i = threadIdx.x; ok && i < n * lines; i += blockDim.x) {
      const int p = static_cast<int>(i / lines);
      const uint32_t o = (i - static_cast<uint32_t>(p) * lines) * 8;
      if (p == a.rank || o >= counts) continue;
      const uint32_t g = sh.base[p] + 1;
      uint64_t v;
      ok = w.line(collSlotFrom(a.reg, p, g) + o * 2, g, v, p);  // line o / 8: 16 bytes each
      if (ok)
        storeBytes(recv_rows + static_cast<uint64_t>(p) * counts + o, v,
                   counts - o < 8u ? counts - o : 8u);
    }
    if (!ok) sh.stop = 1;
    __threadfence();  // the counts before the mark, for the other blocks
    __syncthreads();
    if (threadIdx.x == 0 && !sh.stop) *ready = mark;
  } else {
    if (threadIdx.x == 0 && !w.until([&] { return *ready == mark; }, ref)) sh.stop = 1;
    __syncthreads();
  }
  if (sh.stop) return false;
  // Summed as sumRows does, from the counts block 0 wrote.
  for (uint32_t i = threadIdx.x; i < n * s.per_peer; i += blockDim.x)
    if (i / s.per_peer != static_cast<uint32_t>(a.rank))
      addCount(rows + kMaxRanks, s, recv_rows, i, true);
  clampRows(rows + kMaxRanks, a.nranks, s.max_rows);
  return true;
}

// This rank's own rows and counts, copied by every block in turn (grid-stride).
__device__ inline void copyOwn(const CollectiveArgs& a, const SplitsArgs& s, uint64_t bytes) {
  const PeerPlan& me = a.peers[a.rank];
  const auto* from = static_cast<const unsigned char*>(me.send) + s.header_bytes;
  auto* to = static_cast<unsigned char*>(me.recv) + s.header_bytes;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x * 8;
  for (uint64_t o = (static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; o < bytes;
       o += stride) {
    const uint32_t nb = bytes - o < 8 ? static_cast<uint32_t>(bytes - o) : 8u;
    storeBytes(to + o, loadBytes(from + o, nb), nb);
  }
  const uint32_t counts = s.per_peer * s.count_bytes;
  if (blockIdx.x != 0) return;
  const uint64_t off = static_cast<uint64_t>(a.rank) * counts;
  for (uint32_t i = threadIdx.x; i < counts; i += blockDim.x)
    static_cast<unsigned char*>(const_cast<void*>(s.recv_rows))[off + i] =
        static_cast<const unsigned char*>(s.send_rows)[off + i];
}

// The counts-in-header exchange (see above), after the send rows are summed into rows[0..W).
__device__ inline void headerExchange(CollectiveArgs& a, const SplitsArgs& s, Shared& sh,
                                      unsigned long long* rows) {
  const uint32_t chunk = a.reg.chunk;
  const uint32_t j0 = blockIdx.x * a.parts_per_block;
  for (int p = threadIdx.x; p < a.nranks; p += blockDim.x) {
    PeerPlan& pp = a.peers[p];
    // the rows' addresses less the header: message offset o is at send + o past the header
    pp.send = static_cast<const unsigned char*>(pp.send) - s.header_bytes;
    pp.recv = static_cast<unsigned char*>(pp.recv) - s.header_bytes;
    pp.send_bytes = s.header_bytes + rows[p] * s.row_bytes;
    pp.recv_bytes = 0;  // known from the header
    pp.rounds = 0;
  }
  if (threadIdx.x == 0) {
    uint64_t first_max = 0;
    for (int p = 0; p < a.nranks; ++p) {
      const uint64_t b = p == a.rank ? 0 : s.header_bytes + rows[p] * s.row_bytes;
      first_max = b > first_max ? b : first_max;
    }
    first_max = first_max < chunk ? first_max : chunk;
    a.reg.trigger_fence = first_max >= s.fence_from_bytes ? 1u : 0u;
    // The FIFO positions of this block's round-0 triggers, one per proxied peer it writes to
    // (as reserveRoundZero's): sendRound takes them in order.
    uint32_t triggers = 0;
    for (int p = 0; p < a.nranks; ++p) {
      const uint64_t b = s.header_bytes + rows[p] * s.row_bytes;
      if (p != a.rank && sh.remote[p] == nullptr && j0 < partsOf(roundBytes(b, 0, chunk)))
        ++triggers;
    }
    sh.fifo_pos = triggers ? reserveTriggers(a.reg, triggers) : 0ull;
    sh.stop = 0;
  }
  __syncthreads();
  Waiter w(a.reg, a.op_id);
  const CountsHeader header{s};
  // Round 0: the header words, then rows (pp.send is the rows' address less header_bytes, so
  // one offset serves both), as LL lines.
  for (int p = 0; p < a.nranks; ++p) {
    if (p == a.rank) continue;
    const uint32_t n = partsOf(roundBytes(a.peers[p].send_bytes, 0, chunk));
    if (j0 < n)
      sendRound<false>(a, sh, w, p, 0, j0, min(n, j0 + a.parts_per_block), 0, false, header);
  }
  copyOwn(a, s, rows[a.rank] * s.row_bytes);
  if (!headerRows(a, s, sh, w, rows)) return;
  for (int p = threadIdx.x; p < a.nranks; p += blockDim.x) {
    PeerPlan& pp = a.peers[p];
    if (p == a.rank) continue;  // copied above; no rounds
    pp.recv_bytes = s.header_bytes + rows[kMaxRanks + p] * s.row_bytes;
    const uint64_t larger = pp.send_bytes > pp.recv_bytes ? pp.send_bytes : pp.recv_bytes;
    pp.rounds = static_cast<uint32_t>(roundsOfBytes(larger, chunk));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t rounds_max = 0;
    for (int p = 0; p < a.nranks; ++p)
      rounds_max = a.peers[p].rounds > rounds_max ? a.peers[p].rounds : rounds_max;
    a.rounds_max = rounds_max;
  }
  advanceOnceLoaded(a, sh);  // begins with a barrier: the plan above is visible
  for (int p = 0; p < a.nranks && !sh.stop; ++p) {
    if (p == a.rank) continue;
    const uint32_t n = partsOf(roundBytes(a.peers[p].recv_bytes, 0, chunk));
    if (j0 < n) recvRound(a, sh, w, p, 0, j0, min(n, j0 + a.parts_per_block), header);
  }
  __syncthreads();
  if (!sh.stop) runRounds<false>(a, sh, w, 1, j0, 0, false);
  __syncthreads();
}

template <bool Simple>
__global__ void __launch_bounds__(kThreads) splitsKernel(const __grid_constant__ SplitsArgs s) {
  __shared__ Shared sh;
  __shared__ CollectiveArgs a;
  {
    const auto* from = reinterpret_cast<const uint64_t*>(&s.coll);
    auto* to = reinterpret_cast<uint64_t*>(&a);
    for (uint32_t i = threadIdx.x; i < sizeof(CollectiveArgs) / 8; i += blockDim.x) to[i] = from[i];
  }
  loadRoundState(s.coll, sh);
  // The counts are written by the stream's previous kernels (the counts exchange): wait for
  // them before reading. The round advance below needs the rounds they give.
  pdlWait();
  __syncthreads();                                    // the copy of the args is complete
  __shared__ unsigned long long rows[2 * kMaxRanks];  // send, then recv rows per peer
  sumRows(s, a.nranks, rows);  // header_bytes: the recv rows come from the headers
  if (!Simple && s.header_bytes) {
    headerExchange(a, s, sh, rows);
    return;
  }
  const uint32_t chunk = a.reg.chunk;
  for (int p = threadIdx.x; p < a.nranks; p += blockDim.x) {
    PeerPlan& pp = a.peers[p];
    const uint64_t send = rows[p] * s.row_bytes;
    // This rank's own rows: what it sends itself is what it receives from itself.
    const uint64_t recv = p == a.rank ? send : rows[kMaxRanks + p] * s.row_bytes;
    pp.send_bytes = send;
    pp.recv_bytes = recv;
    pp.rounds = static_cast<uint32_t>(roundsOfBytes(send > recv ? send : recv, chunk));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t rounds_max = 0;
    uint64_t first_max = 0;
    for (int p = 0; p < a.nranks; ++p) {
      const PeerPlan& pp = a.peers[p];
      rounds_max = pp.rounds > rounds_max ? pp.rounds : rounds_max;
      const uint64_t b = pp.send_bytes > pp.recv_bytes ? pp.send_bytes : pp.recv_bytes;
      const uint64_t first = b < chunk ? b : chunk;
      first_max = first > first_max ? first : first_max;
    }
    a.rounds_max = rounds_max;
    // As GpuCommunicator::fenceTriggers decides from the host's byte counts.
    a.reg.trigger_fence = first_max >= s.fence_from_bytes ? 1u : 0u;
  }
  advanceOnceLoaded(a, sh);  // begins with a barrier: the plan above is visible
  // The next kernel launches when this one's blocks exit, as after a collective of several
  // rounds (enterCollective).
  collectiveBody<Simple>(a, sh);
}

}  // namespace

int splitsBlocksPerSm(bool simple) {
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &n, simple ? splitsKernel<true> : splitsKernel<false>, kThreads, 0);
  return n;
}

cudaError_t loadSplitsKernels() {
  return loadFunctions({reinterpret_cast<const void*>(splitsKernel<false>),
                        reinterpret_cast<const void*>(splitsKernel<true>)});
}

cudaError_t launchSplits(const SplitsArgs& args, unsigned blocks, cudaStream_t stream) {
  if (args.coll.reg.simple != 0) return launchKernel<splitsKernel<true>>(args, blocks, stream);
  return launchKernel<splitsKernel<false>>(args, blocks, stream);
}

}  // namespace gpu
}  // namespace resident
