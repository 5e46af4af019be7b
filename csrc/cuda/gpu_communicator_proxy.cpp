// The proxy side of the CUDA path: drains the trigger FIFO that the kernels fill (mapped host
// memory), checks the lines of unfenced triggers, and posts the writes through the transport.
// Runs on the communicator's resident proxy thread (GpuCommunicator is its extra poller).
#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/clock.hpp"
#include "core/engine.hpp"
#include "core/log.hpp"
#include "core/proxy/trigger_encoding.hpp"
#include "core/proxy/write_batch.hpp"
#include "core/transport/streaming_copy.hpp"
#include "cuda/cuda_guards.hpp"
#include "cuda/gpu_communicator.hpp"

namespace resident {

bool GpuCommunicator::linesArrived(const unsigned char* lines, uint64_t bytes,
                                   uint32_t flag) const {
  // The kernel issued the lines before the trigger, so they are at most a PCIe trip behind;
  // the wait still ends on the group's abort word (shutdown sets it before it detaches the
  // proxy) and after the group's timeout, should the GPU have stopped mid-op.
  const auto* abort_word = reinterpret_cast<const uint64_t*>(
      comm_.segmentBase() + comm_.gpuRegionOffset() + GpuLayout::kAbortWord);
  uint64_t deadline = 0;
  // Whole lines only (a range of lines always is; a stray tail is not waited for). Each pass
  // skips the lines that landed, then waits for the first one that has not.
  for (uint64_t off = linesLanded(lines, bytes, flag); off + 16 <= bytes;
       off += linesLanded(lines + off, bytes - off, flag)) {
    // Polls the one line, without prefetch.
    for (uint32_t spins = 0; landedLlLines(lines + off, 16, flag, 0) == 0;) {
      if (++spins % 1024 != 0) continue;
      if (__atomic_load_n(abort_word, __ATOMIC_ACQUIRE) != 0) return false;
      const uint64_t now = nowNs();
      if (deadline == 0) deadline = now + timeout_ns_.load(std::memory_order_relaxed);
      if (now > deadline) return false;
    }
  }
  return true;
}

void GpuCommunicator::logWaitState() const {
  // What the failed rank's side of each proxied peer looks like: the flags in its inbox slots
  // (lines whose two flags agree, by value, and torn ones) and what the transport holds.
  const GpuLayout& lay = comm_.gpuLayout();
  const unsigned char* region = comm_.segmentBase() + comm_.gpuRegionOffset();
  auto slotFlags = [&](const unsigned char* lines, size_t bytes) {
    uint32_t first = 0, last = 0;
    size_t first_n = 0, last_n = 0, torn = 0;
    for (size_t off = 0; off + 16 <= bytes; off += 16) {
      uint32_t f0, f1;
      std::memcpy(&f0, lines + off + 4, 4);
      std::memcpy(&f1, lines + off + 12, 4);
      if (f0 != f1) {
        ++torn;
      } else if (off == 0 || f0 == first) {
        first = f0;
        ++first_n;
      } else {
        if (f0 != last) last_n = 0;
        last = f0;
        ++last_n;
      }
    }
    return "flag " + std::to_string(first) + " x" + std::to_string(first_n) + ", then flag " +
           std::to_string(last) + " x" + std::to_string(last_n) + ", torn " + std::to_string(torn);
  };
  RLOG_ERROR("rank %d: host callers waiting on CPU ops of the group: %s", rank_,
             comm_.engine().hasWaiters() ? "yes" : "no");
  logDeviceRounds();
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_ || ((region_.proxied >> p) & 1) == 0) continue;
    std::string s = "rank " + std::to_string(rank_) + " from rank " + std::to_string(p) + ":";
    for (uint32_t slot = 0; slot < GpuLayout::kCollSlots; ++slot)
      s += " coll slot " + std::to_string(slot) + ": " +
           slotFlags(region + lay.collIn(p) + slot * lay.slotBytes(), lay.slotBytes()) + ";";
    for (uint32_t slot = 0; slot < GpuLayout::kCollSlots; ++slot)
      s += " sent coll slot " + std::to_string(slot) + ": " +
           slotFlags(outbox_host_ + lay.outColl(p) + slot * lay.slotBytes(), lay.slotBytes()) + ";";
    s += " " + comm_.transport().peerState(p);
    RLOG_ERROR("%s", s.c_str());
  }
}

void GpuCommunicator::logDeviceRounds() const {
  // The device's collective round with each peer (past the op that gave up: a kernel advances
  // them as it starts), read on a stream of its own with a bounded wait, so that a GPU that
  // stopped cannot hold the proxy here. While tracing, beside the host's count (logRounds).
  DeviceGuard guard(device_);
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return;
  std::vector<uint32_t> rounds(static_cast<size_t>(nranks_), 0);
  bool read = cudaMemcpyAsync(rounds.data(), state_->coll_round, rounds.size() * sizeof(uint32_t),
                              cudaMemcpyDeviceToHost, s) == cudaSuccess;
  const uint64_t deadline = nowNs() + 1000000000ull;
  cudaError_t q = cudaErrorNotReady;
  while (read && (q = cudaStreamQuery(s)) == cudaErrorNotReady && nowNs() < deadline) {
  }
  read = read && q == cudaSuccess;
  if (q != cudaErrorNotReady) cudaStreamDestroy(s);  // else leaked: the copy may still land
  if (!read) {
    RLOG_ERROR("rank %d: the device's round counters could not be read", rank_);
    return;
  }
  const bool traced = logLevel() >= LogLevel::kTrace;
  std::string line;
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    line += " " + std::to_string(p) + ":" + std::to_string(rounds[static_cast<size_t>(p)]);
    if (traced) line += "/" + std::to_string(host_rounds_[p].load(std::memory_order_relaxed));
  }
  RLOG_ERROR("rank %d of %d: collective rounds with peers on the device%s:%s", rank_, nranks_,
             traced ? " / as the host counted them" : "", line.c_str());
}

bool GpuCommunicator::holdCredit(int peer, uint32_t slot, uint64_t& now) {
  if (now == 0) now = nowNs();
  uint64_t& seen = credit_seen_ns_[static_cast<size_t>(peer)][slot];
  const uint64_t last_write = last_write_ns_[static_cast<size_t>(peer)];
  if (last_write != 0 && now - last_write < kCreditHoldRecentNs) {
    if (seen == 0) seen = now;
    if (now - seen < kCreditHoldNs) return true;
  }
  seen = 0;
  return false;
}

bool GpuCommunicator::forwardCredits(uint64_t written_peers, uint64_t now) {
  // Credits only follow the recv kernel's reads of the slot (done before it stored the word),
  // not any write of this rank, so they need no place in the FIFO's order. Each word is one
  // aligned 8-byte store and only grows, so a read sees it whole, never moving backwards.
  const GpuLayout& lay = comm_.gpuLayout();
  Transport& transport = comm_.transport();
  // Network peers with no write in this pass: a credit may wait for one to share its message
  // (holdCredit); shm signals cost no message.
  const uint64_t holdable = region_.network_rule & ~written_peers;
  bool forwarded = false;
  for (int p = 0; p < nranks_; ++p) {
    if (((region_.proxied >> p) & 1) == 0) continue;
    const auto* words = reinterpret_cast<const uint64_t*>(outbox_host_ + lay.outCredit(p));
    for (uint32_t slot = 0; slot < GpuLayout::kP2PSlots; ++slot) {
      const uint64_t credit = __atomic_load_n(words + slot, __ATOMIC_RELAXED);
      if (credit == credit_sent_[static_cast<size_t>(p)][slot]) continue;
      forwarded = true;  // a held credit keeps the proxy hot too
      if (((holdable >> p) & 1) != 0 && holdCredit(p, slot, now)) continue;
      credit_seen_ns_[static_cast<size_t>(p)][slot] = 0;
      transport.signal(p, comm_.gpuRegionOffset() + lay.creditIn(rank_) + 8ull * slot, credit);
      if (trace_) trace_->record(TraceEvent::kCredit, p, 8);
      credit_sent_[static_cast<size_t>(p)][slot] = credit;
    }
  }
  return forwarded;
}

template <typename BeforeWait>
bool GpuCommunicator::writeLinesAsTheyLand(const GpuWriteRequest& r, BeforeWait&& before_wait) {
  Transport& transport = comm_.transport();
  const unsigned char* lines = outbox_host_ + r.local_offset;
  const size_t remote = comm_.gpuRegionOffset() + r.remote_offset;
  const int peer = static_cast<int>(r.peer);
  for (uint64_t done = 0;;) {
    const uint64_t now = transport.writeLandedLines(peer, remote + done, lines + done,
                                                    r.bytes - done, r.value, kProxyPrefetchBytes);
    if (trace_ && now != 0) trace_->record(TraceEvent::kPosted, peer, now);
    done += now;
    if (done + 16 > r.bytes) return true;
    // A line still in flight: what is batched goes out first (the peer can start on it).
    before_wait();
    if (!linesArrived(lines + done, 16, r.value)) return false;
  }
}

bool GpuCommunicator::proxyPoll() {
  // A group that failed, or a peer that died or failed, stops the kernels that still wait (the
  // host cannot tell which peer a running kernel waits for): they exit on the abort word, and
  // the host reports the error.
  if (!kernels_aborted_ && (comm_.engine().poisoned() || comm_.engine().anyPeerFailed())) {
    kernels_aborted_ = true;
    if (!comm_.engine().poisoned()) comm_.engine().poison(comm_.engine().firstPeerFailure());
    abortKernels();
  }
  // Drain what the kernels pushed into a batch of writes (fixed arrays, no allocation), posted
  // in outbox order with adjacent ranges merged (sortAndMergeWrites) whenever FIFO order requires
  // it (lines still in flight), when full, and at the end of the pass. The simple
  // protocol's flags wait for the next post and are raised right after it: a signal is ordered
  // behind every write posted before it to the same peer. Side by side on the H200
  // this was 4-15% faster than posting each part's copy and flags as they came, from 16 KiB.
  // Unfenced LL lines to a transport that fuses (shm) skip the batch: each trigger's lines are
  // checked and copied in one pass as it is popped, one fence per pass before the batch's posts
  // (H200: 14-24% faster at 16-32 KiB than checking first, docs/decisions.md).
  BatchWrite batch[64];
  int n = 0;
  struct Flag {
    int peer;
    uint64_t offset;
    uint32_t value;
  };
  Flag flags[64];
  int nflags = 0;
  Transport& transport = comm_.transport();
  bool unflushed_lines = false;  // fused writes not yet behind a flushDeviceWrites
  auto flush = [&] {
    if (unflushed_lines) {
      transport.flushDeviceWrites();
      unflushed_lines = false;
    }
    n = sortAndMergeWrites(batch, n);
    for (int i = 0; i < n; ++i) {
      const size_t remote = comm_.gpuRegionOffset() + batch[i].remote;
      transport.writeForDevice(batch[i].peer, remote, outbox_host_ + batch[i].local, batch[i].bytes,
                               kProxyPrefetchBytes);
      if (trace_) trace_->record(TraceEvent::kPosted, batch[i].peer, batch[i].bytes);
    }
    n = 0;
    for (int i = 0; i < nflags; ++i)
      transport.signal(flags[i].peer, comm_.gpuRegionOffset() + flags[i].offset,
                       uint64_t{flags[i].value} << 32);
    if (trace_ && nflags > 0) trace_->record(TraceEvent::kFlags, flags[0].peer, nflags);
    nflags = 0;
  };
  int popped = 0;
  uint64_t written_peers = 0;
  Trigger t;
  while (popped < 256 && ring_.tryPop(t)) {
    ++popped;
    const GpuWriteRequest r = decodeWrite(t.fst, t.snd);
    if (trace_)
      trace_->record(r.kind == TriggerKind::kFlag   ? TraceEvent::kPopFlag
                     : r.kind == TriggerKind::kCopy ? TraceEvent::kPopCopy
                                                    : TraceEvent::kPopLines,
                     static_cast<int>(r.peer), r.bytes);
    const uint64_t peer_bit = r.peer < gpu::kMaxRanks ? 1ull << r.peer : 0;
    written_peers |= peer_bit;
    if (r.kind == TriggerKind::kCopy && (region_.network_rule & peer_bit) != 0) {
      // tcp's sendmsg copies this payload from the outbox with this core, and the GPU wrote
      // it: not in the core's caches. Fetched as each part's trigger is popped, it is there by
      // the time the op's last part is (docs/decisions.md, the tcp data path; an ib NIC reads
      // it itself, and the fetch costs it only these instructions).
      prefetchStart(outbox_host_ + r.local_offset, r.bytes, r.bytes);
    }
    if (r.kind == TriggerKind::kFlag) {  // raised after the next post (flush)
      for (uint64_t off = 0; off + 16 <= r.bytes; off += kSimpleFlagStride) {
        if (nflags == 64) flush();
        flags[nflags++] = {static_cast<int>(r.peer), r.remote_offset + off + 8, r.value};
      }
      continue;
    }
    bool arrived = true;
    if (r.kind == TriggerKind::kLines && (fused_peers_ & peer_bit) != 0) {
      // The lines checked and copied in one pass, now. Marked
      // unflushed first: a flush inside the call (before a wait) fences what it copied so far.
      unflushed_lines = true;
      arrived = writeLinesAsTheyLand(r, [&] { flush(); });
      if (arrived) continue;
    } else if (r.kind == TriggerKind::kLines) {
      const unsigned char* lines = outbox_host_ + r.local_offset;
      const uint64_t landed = linesLanded(lines, r.bytes, r.value);
      // Lines still in flight: post the writes already checked (the peer can start on those),
      // then wait for the rest.
      if (landed + 16 <= r.bytes) {
        flush();
        arrived = linesArrived(lines + landed, r.bytes - landed, r.value);
      }
      // The payload words are read (by the transport) after the flags that vouch for them.
      __atomic_thread_fence(__ATOMIC_ACQUIRE);
    }
    if (!arrived) {
      const std::string err = "resident: rank " + std::to_string(rank_) +
                              ": the proxy gave up on lines a kernel announced (to rank " +
                              std::to_string(r.peer) +
                              "): the group was aborted, or the GPU stopped mid-op and they did "
                              "not arrive within the group's timeout";
      RLOG_ERROR("%s", err.c_str());
      comm_.engine().poison(err);
      abortKernels();
      break;
    }
    const BatchWrite w{static_cast<int>(r.peer), r.local_offset, r.remote_offset, r.bytes};
    if (n > 0 && continuesWrite(batch[n - 1], w)) {  // in FIFO order already: no slot taken
      batch[n - 1].bytes += w.bytes;
      continue;
    }
    if (n == 64) flush();
    batch[n++] = w;
  }
  flush();
  if (popped > 0) ring_.publishTail();
  // When each network peer was last written to (for holdCredit): one clock read per pass that
  // posted to one, shared with forwardCredits.
  uint64_t now = 0;
  if (const uint64_t net_written = written_peers & region_.network_rule; net_written != 0) {
    now = nowNs();
    for (uint64_t m = net_written; m != 0; m &= m - 1)
      last_write_ns_[static_cast<size_t>(__builtin_ctzll(m))] = now;
  }
  // The credits after the FIFO: one sent beside a write to its peer shares its message.
  const bool credited = any_proxied_ && forwardCredits(written_peers, now);
  if (!error_logged_.load(std::memory_order_relaxed)) {
    const std::string err = deviceError();
    if (!err.empty()) {
      error_logged_.store(true);
      RLOG_ERROR("%s", err.c_str());
      logWaitState();
      failGroup(err);
    }
  }
  return popped > 0 || credited;
}

}  // namespace resident
