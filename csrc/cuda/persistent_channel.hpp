// Host side of the resident kernel (RESIDENT_GPU_PERSISTENT=1): owns its device state, the
// descriptor table and the mapped host words, hands ops over with stream memory operations
// (persistent_args.hpp describes the protocol), and keeps an instance on the GPU: launched at
// install, by the caller's thread before an eager op's doorbell when none runs, and, with
// RESIDENT_GPU_PERSISTENT_GRAPHS=resident, by a launcher thread the proxy (poll) wakes when a
// graph replay handed over an op while none runs (an idle instance leaves after
// RESIDENT_GPU_PERSISTENT_IDLE_US). Torch-free,
// and its header CUDA-free (streams are opaque handles), like gpu_communicator.hpp.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "core/descriptor_slots.hpp"
#include "cuda/stream_memops.hpp"
#include "persistent_args.hpp"

namespace resident {

struct PersistentStatus {
  bool running = false;  // launched, began and not yet left
  bool queued = false;   // launched but not yet begun (waiting behind other GPU work)
  uint32_t launches = 0, exits = 0, served = 0, graph_slots_used = 0, slots = 0, blocks = 0;
  // Diagnostics of the hand-off (what a stuck op waits for): the mailbox tag (0: no op
  // waits), the last eager stamp handed to a stream and the last completed one, how often the
  // proxy thread looked (polls) and whether it is inside a relaunch right now.
  uint32_t mailbox = 0, issued = 0, eager_done = 0;
  uint64_t polls = 0;
  bool in_launch = false;
};

class PersistentChannel {
 public:
  // `simple`: the group's Region::simple (which build of the kernel runs its descriptors);
  // `failed`, `abort_word`: the group's DeviceState::failed and abort word (device pointers).
  // `args_bytes`: the meaningful bytes of this group's descriptors (header + its peers).
  PersistentChannel(int device, uint32_t blocks, uint32_t slots, uint64_t idle_us,
                    uint64_t timeout_ms, bool simple, size_t args_bytes, const uint32_t* failed,
                    const uint64_t* abort_word);
  ~PersistentChannel();
  PersistentChannel(const PersistentChannel&) = delete;
  PersistentChannel& operator=(const PersistentChannel&) = delete;

  uint32_t blocks() const { return blocks_; }
  // Hands collective `args` (its first `args_bytes` bytes are meaningful) to the resident kernel on
  // `stream`, which is capturing a graph or not (`captured`, the caller asked the stream):
  // the stream continues once the op completed.
  void enqueue(const gpu::CollectiveArgs& args, void* stream, bool captured);
  // Proxy thread: the watchdog, and a relaunch request to the launcher thread if an op waits
  // and no instance runs. Never blocks (the proxy also moves the proxy path's data). True if
  // it asked for a launch.
  bool poll();
  // Makes the running instance leave (after its current op) and waits for it, bounded by the
  // group timeout; no relaunch afterwards. Idempotent; the destructor calls it. status() and
  // stuckError() stay valid afterwards.
  void stop();
  PersistentStatus status() const;
  // Non-empty once the watchdog in poll() found an op the resident kernel never ran (the
  // group is then unusable; the op's stream was released).
  std::string stuckError() const;
  void setTimeoutMs(uint64_t ms) { timeout_ms_ = ms; }

 private:
  // IDLE_US=0 (never leave) needs eager module loading: throws InvalidArgument otherwise.
  static void requireEagerLoading();
  void launchLocked();
  // The launcher thread: launches an instance when poll() asks for one (a graph replay's op
  // waits and none runs; only with RESIDENT_GPU_PERSISTENT_GRAPHS=resident). Its own thread,
  // so that the proxy and its watchdog (which releases that stream after the timeout) never
  // wait on a launch: such a launch blocks inside the driver for as long as the caller sits in
  // a pageable copy on the legacy default stream behind the replay (H200,
  // scripts/launch_block_probe.cu).
  void launcherLoop();
  void askLauncherToQuit();
  void stopLauncher();  // asks the launcher thread to leave and joins it
  // An instance runs and is not leaving: it will see an op whose `issued` is published.
  bool instanceStays() const;
  // An op waits in the mailbox and no instance runs (a graph replay after an idle exit).
  bool opWaitsForLaunch() const;
  // Caller's thread, eager op, after `issued` was published and before its doorbell: launches
  // an instance unless one runs that will see the op (not leaving by itself).
  void ensureInstance();
  void watch();
  uint32_t loadHost(const uint32_t* word) const;
  void waitEagerDone(uint32_t stamp);
  void upload(uint32_t slot, const gpu::CollectiveArgs& args);
  void release();

  const int device_;
  const uint32_t blocks_;
  const bool simple_;  // the kernel's build with the simple protocol
  const size_t args_bytes_;
  const size_t mirror_stride_;  // args_bytes_ rounded up to a cache line
  const uint32_t eager_slots_;
  const uint64_t idle_ns_;
  const uint32_t* const failed_;
  const uint64_t* const abort_word_;
  std::atomic<uint64_t> timeout_ms_;
  StreamMemOps memops_;
  DescriptorSlots slots_;
  gpu::PersistentState* state_ = nullptr;         // device memory
  gpu::CollectiveArgs* table_ = nullptr;          // device memory: the kernel's cache
  uint32_t* table_generation_ = nullptr;          // device memory, per slot
  unsigned char* mirror_ = nullptr;               // mapped host memory: the descriptors
  const unsigned char* mirror_dev_ = nullptr;     // ... its device pointer
  gpu::PersistentHostWords* host_ = nullptr;      // mapped host memory (host pointer)
  gpu::PersistentHostWords* host_dev_ = nullptr;  // ... its device pointer
  void* run_stream_ = nullptr;  // cudaStream_t (non-blocking): where instances run
  // launch_mu_: launches and stop (install, callers' threads, launcher thread, shutdown).
  // table_mu_: the slot table and uploads (callers' threads). Separate, so that a caller
  // waiting for a slot never blocks the relaunch it may be waiting for. Timed: stop() must not
  // wait forever on a launch that blocks (see launcherLoop).
  mutable std::timed_mutex launch_mu_;
  mutable std::mutex table_mu_;
  // Written under launch_mu_; atomic so that status() never waits for a launch in progress.
  std::atomic<uint32_t> launches_{0};
  std::atomic<uint64_t> polls_{0};      // poll() calls (diagnostics)
  std::atomic<bool> in_launch_{false};  // launchLocked() is running (diagnostics)
  // watch() (proxy thread only): the served count last seen and since when an op waits
  // without progress.
  uint32_t watch_served_ = 0;
  std::chrono::steady_clock::time_point watch_since_{};
  // Written once by watch(), then immutable: readers check stuck_set_ first (every op's
  // usability check reads it, so no lock and no copy until it is set).
  std::string stuck_;
  std::atomic<bool> stuck_set_{false};
  uint32_t eager_stamp_ = 0;           // under table_mu_
  void* last_eager_stream_ = nullptr;  // under table_mu_: the stream of the last eager op
  std::atomic<bool> stopped_{false};
  std::mutex want_mu_;  // guards want_launch_ and launcher_quit_
  std::condition_variable want_cv_;
  bool want_launch_ = false;
  bool launcher_quit_ = false;
  std::thread launcher_;
};

}  // namespace resident
