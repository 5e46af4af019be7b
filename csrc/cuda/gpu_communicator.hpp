// The CUDA path of a communicator, installed on first use of a CUDA tensor: registers the
// segments (own and same-host peers') as mapped pinned memory, allocates the device-side
// sequence state, and launches one kernel per op on the caller's stream. Its proxyPoll runs
// on the communicator's resident proxy thread: it drains the trigger FIFO the kernels fill
// on the proxy path and posts the writes through the transport. Torch-free; streams are
// passed as opaque handles (cudaStream_t).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/communicator.hpp"
#include "core/dtype.hpp"
#include "core/gpu_layout.hpp"
#include "core/proxy/fifo.hpp"
#include "core/proxy/proxy_trace.hpp"
#include "core/transport/ll_line_check.hpp"
#include "exchange_args.hpp"

namespace resident {

class GpuCommunicator : public ProxyHandler {
 public:
  GpuCommunicator(Communicator& comm, int device, uint64_t timeout_ms);
  ~GpuCommunicator() override;
  GpuCommunicator(const GpuCommunicator&) = delete;
  GpuCommunicator& operator=(const GpuCommunicator&) = delete;

  int device() const { return device_; }

  // Every op enqueues one kernel on `stream` and returns; byte counts and element counts as
  // in Communicator. Per-rank pointer arrays have nranks entries.
  void allReduce(const void* in, void* out, size_t count, DType dtype, RedOp op, void* stream);
  void reduceScatter(const void* in, void* out, size_t count, DType dtype, RedOp op, void* stream);
  void reduceScatterV(const void* const* inputs, void* out, size_t count, DType dtype, RedOp op,
                      void* stream);
  void reduce(const void* in, void* out, size_t count, DType dtype, RedOp op, int root,
              void* stream);
  void allGather(const void* in, void* const* outs, size_t bytes, void* stream);
  void gather(const void* in, void* const* outs, size_t bytes, int root, void* stream);
  void scatter(const void* const* ins, void* out, size_t bytes, int root, void* stream);
  void allToAll(const void* const* ins, const size_t* in_bytes, void* const* outs,
                const size_t* out_bytes, void* stream);
  void broadcast(void* buf, size_t bytes, int root, void* stream);
  // all_to_all of capacity buffers: peer p's rows at send + p * max_rows * row_bytes and
  // recv + p * max_rows * row_bytes; send_rows / recv_rows ([nranks][per_peer] int32 or int64
  // by count_bytes, device memory) give the rows of each peer as the sum of its per_peer counts,
  // read by the kernel when it runs (clamped to [0, max_rows]); rows past them are neither sent
  // nor written. Grid and round budget come from the capacity; the rounds with each peer from
  // the counts, which must agree across each pair (send_rows[q] here == recv_rows[this rank]
  // on q). counts_out: recv_rows is written instead, each message carrying its counts ahead
  // of its rows (one exchange where counts, then rows, would take two).
  void allToAllDeviceSplits(const void* send, void* recv, size_t max_rows, size_t row_bytes,
                            const void* send_rows, const void* recv_rows, uint32_t count_bytes,
                            uint32_t per_peer, bool counts_out, void* stream);
  void send(const void* buf, size_t bytes, int peer, void* stream);
  void recv(void* buf, size_t bytes, int peer, void* stream);

  void setTimeoutMs(uint64_t ms) { timeout_ns_.store(ms * 1000000ull, std::memory_order_relaxed); }
  // Empty while no kernel gave up; otherwise why, naming the op and the peer.
  std::string deviceError() const;
  // deviceError(), and when it is not empty the group fails with it now (as the proxy pass
  // would at its next check), so that get_error() agrees with the error the caller raises.
  std::string deviceErrorFailingGroup() const;
  // Poisons the group with a kernel's error `err` (a peer that left noted as its cause).
  void failGroup(const std::string& err) const;
  // Whether that error is a kernel's own timeout (the group's error kind: Communicator::error).
  bool deviceTimedOut() const;
  // Makes every kernel of this communicator still waiting give up (shutdown, abort).
  void abortKernels();
  // Waits for this communicator's eager work, detaches from the proxy and releases the
  // registrations and device memory. Idempotent; the destructor calls it.
  void shutdown();

  bool proxyPoll() override;

 private:
  // An orderly shutdown: the proxy forwards what this rank's finished kernels pushed before the
  // peers are told it left (a kernel ends once it has its peers' data, not once its own is out).
  void drainTriggers();
  uint64_t deviceErrorWord() const;  // the word a kernel that gave up wrote (0: none)
  enum OpId : uint8_t {
    kAllReduce,
    kReduceScatter,
    kReduce,
    kAllGather,
    kGather,
    kScatter,
    kAllToAll,
    kBroadcast,
    kSend,
    kRecv,
    kAllToAllDeviceSplits
  };
  gpu::CollectiveArgs& begin(OpId op);
  // The region as an op's kernel sees it: the group's, with the group's current timeout.
  gpu::Region opRegion() const;
  void partner(int p, const void* send, size_t send_bytes, void* recv, size_t recv_bytes);
  void launchCollective(void* stream);
  void launchP2P(bool is_send, const void* src, void* dst, size_t bytes, int peer, void* stream);
  void checkUsable() const;
  // The group's check of (dtype, op), and that the device kernels reduce that dtype.
  void checkReduction(DType dtype, RedOp op, const char* what) const;
  uint32_t roundsFor(size_t bytes) const;  // in rounds of the group's chunk
  static uint32_t roundsFor(size_t bytes, uint32_t chunk);
  void pinProxyNearDevice();
  // RESIDENT_GPU_FIRST_ROUND: every channel starts at round `first` (into `state`, before it is
  // copied to the device).
  void startRoundsAt(uint32_t first, gpu::DeviceState& state);
  // Proxy side of a checked trigger (the kernel did not fence the lines before it): the bytes
  // of the range's leading lines that carry `flag`, without waiting.
  uint64_t linesLanded(const unsigned char* lines, uint64_t bytes, uint32_t flag) const {
    return landedLlLines(lines, bytes, flag, kProxyPrefetchBytes);
  }
  // Waits until every LL line of the range carries `flag` (the caller fences before the payload
  // is read). False on abort or after the group's timeout.
  bool linesArrived(const unsigned char* lines, uint64_t bytes, uint32_t flag) const;
  // Posts the lines of an unfenced trigger as they land
  // (Transport::writeLandedLines), calling before_wait() before each wait for a line in flight.
  // False when a line did not arrive (abort, or the group's timeout).
  template <typename BeforeWait>
  bool writeLinesAsTheyLand(const GpuWriteRequest& r, BeforeWait&& before_wait);
  // Proxy side of send/recv flow control: a recv kernel stores the credit it returns to a
  // proxied sender into this rank's outbox (a word per peer and slot); forwards each one that
  // changed as a signal into the sender's credit words. True when it forwarded any.
  // `written_peers`: the peers this pass posted writes to; `now`: the pass's clock read, or 0.
  bool forwardCredits(uint64_t written_peers, uint64_t now);
  // Whether a changed credit to network peer `peer` waits (kCreditHoldNs) for a write to share
  // its message; reads the clock into `now` if it is 0.
  bool holdCredit(int peer, uint32_t slot, uint64_t& now);
  // Region::trigger_fence for an op whose largest round to one peer has this many bytes.
  uint32_t fenceTriggers(uint64_t first_round_bytes) const;
  uint32_t blocksFor(uint64_t first_round_bytes) const;
  void writeTrace();         // RESIDENT_GPU_PROXY_TRACE, at shutdown
  void writeKernelStamps();  // the same, once the kernels are done
  // RESIDENT_DEBUG=trace: per collective launch, each partner's expected rounds (host_rounds_).
  void logRounds(const gpu::CollectiveArgs& a);
  static const char* opName(uint32_t id);  // an OpId's name, as errors and logs say it
  // Logs, when a kernel gave up, the state of each proxied peer's inbox slots and connection.
  void logWaitState() const;
  void logDeviceRounds() const;  // part of logWaitState

  Communicator& comm_;
  const int rank_, nranks_;
  int device_ = -1;
  // How far ahead the proxy asks for the outbox bytes it checks (unfenced LL lines) and
  // copies: a GPU's lines are cache misses to the CPU. 1 KiB was faster than none in 12-16 of
  // 16 proxied cells of two of three side-by-side runs on the H200; 4 KiB was no better.
  static constexpr uint32_t kProxyPrefetchBytes = 1024;
  // Proxied rounds of at least this many bytes to one peer fence their triggers on the device;
  // smaller ones leave the lines to the proxy's check (fenceTriggers).
  static constexpr uint64_t kFenceFromBytes = 64 * 1024;
  // Proxied ops whose first round to the peer carries more than this many bytes (capped at half
  // a chunk) go as payload + flags raised by the proxy; smaller ones as LL lines.
  static constexpr uint32_t kProxySimpleAbove = 32 * 1024;
  // The same over a network transport (tcp, ib), where every byte costs the proxy and the wire
  // (LL lines are twice the payload). tcp on the H200, 2 ranks, graphs: above 8 KiB 64 KiB
  // all_gather, reduce_scatter and all_to_all (32 KiB per peer) took 26-30 µs against 37-50
  // as LL lines; above 2 KiB, 4 KiB ops lost 1-4 µs (docs/decisions.md).
  static constexpr uint32_t kNetworkSimpleAbove = 8 * 1024;
  // Direct pairs (RESIDENT_GPU_PROTOCOL=simple): above 32 KiB too, whatever the chunk (a
  // larger chunk only makes the rounds of large ops fewer).
  static constexpr uint32_t kDirectSimpleAbove = 32 * 1024;
  // A p2p credit for a network peer waits up to kCreditHoldNs for a write to the same peer to
  // share its message (a recv followed by a send back, as in a ping-pong, sends one message
  // instead of two; tcp on the H200: 8 B send/recv 9.0 against 12.3 µs) — only while this rank
  // wrote to that peer within kCreditHoldRecentNs: a one-way stream of sends gets its credits
  // at once (a held credit would slow the sender, which has two slots).
  static constexpr uint64_t kCreditHoldNs = 5000;
  static constexpr uint64_t kCreditHoldRecentNs = 100000;
  // drainTriggers' bound: the proxy is hot for gpu_proxy_spin_us after a trigger, so a healthy
  // drain takes microseconds; a kernel that never pushes what it announced ends the wait.
  static constexpr uint64_t kDrainNs = 1000000000ull;
  // Blocks per kernel: every rank sharing this GPU must have all blocks of its current op
  // (and, with PDL, of its next one) resident at once, or the lockstep could deadlock.
  uint32_t max_blocks_ = gpu::kMaxBlocks;
  uint32_t split_max_blocks_ = 1;  // the same for the device-splits all_to_all's kernel
  gpu::Region region_{};           // written only at set-up: launches on other threads copy it
  // The device-side timeout (region_.timeout_ns of each launch): set by any thread at any time.
  std::atomic<uint64_t> timeout_ns_{0};
  gpu::DeviceState* state_ = nullptr;
  unsigned char* outbox_host_ = nullptr;
  std::vector<void*> registered_;
  TriggerRingView ring_;
  gpu::CollectiveArgs args_{};  // reused by every collective launch (no allocation per op)
  std::atomic<bool> error_logged_{false};
  bool kernels_aborted_ = false;  // proxy pass only: the abort word was raised for a failed group
  bool any_proxied_ = false;
  // Bit p: the proxy checks and copies peer p's unfenced lines in one pass as it pops them
  // (on a transport that fuses: shm).
  uint64_t fused_peers_ = 0;
  // forwardCredits: per peer, the credit last forwarded for each p2p slot (proxy thread only).
  std::vector<std::array<uint64_t, GpuLayout::kP2PSlots>> credit_sent_;
  // When a credit not yet forwarded was first seen (0: none waits), for kCreditHoldNs.
  std::vector<std::array<uint64_t, GpuLayout::kP2PSlots>> credit_seen_ns_;
  std::vector<uint64_t> last_write_ns_;  // per peer: when a pass last posted a write to it
  // Collective rounds launched eagerly with each peer while tracing, as the host counts them
  // (logRounds; logDeviceRounds reads them on the proxy thread).
  std::unique_ptr<std::atomic<uint64_t>[]> host_rounds_;
  // RESIDENT_GPU_PROXY_TRACE: the proxy's timeline, written at shutdown (null: off), and the
  // general kernel's (Region::stamps, device memory), written beside it with its number.
  std::unique_ptr<ProxyTrace> trace_;
  unsigned long long* stamps_ = nullptr;
  int trace_serial_ = -1;
  bool shut_down_ = false;
  std::string final_error_;  // deviceError() when shut down (the segments are gone then)
};

}  // namespace resident
