#include "cuda/persistent_channel.hpp"

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "core/log.hpp"
#include "cuda/cuda_guards.hpp"
#include "cuda/module_loading.hpp"
#include "persistent_launch.hpp"

namespace resident {
namespace {

// Every live channel's host words, so that a normal process exit (without
// destroy_process_group) tells each resident kernel to leave before CUDA is torn down.
std::mutex g_live_mu;
std::vector<gpu::PersistentHostWords*>* g_live = nullptr;

void quitAllAtExit() {
  std::lock_guard<std::mutex> lock(g_live_mu);
  if (g_live == nullptr) return;
  for (auto* w : *g_live) __atomic_store_n(&w->quit, 1u, __ATOMIC_RELEASE);
}

void addLive(gpu::PersistentHostWords* w) {
  std::lock_guard<std::mutex> lock(g_live_mu);
  if (g_live == nullptr) {
    g_live = new std::vector<gpu::PersistentHostWords*>();  // never freed: used at exit
    std::atexit(quitAllAtExit);
  }
  g_live->push_back(w);
}

void removeLive(gpu::PersistentHostWords* w) {
  std::lock_guard<std::mutex> lock(g_live_mu);
  if (g_live == nullptr) return;
  for (size_t i = 0; i < g_live->size(); ++i) {
    if ((*g_live)[i] == w) {
      (*g_live)[i] = g_live->back();
      g_live->pop_back();
      return;
    }
  }
}

constexpr uint32_t kEagerSlots = 64;

cudaStream_t* asStream(void** p) {
  return reinterpret_cast<cudaStream_t*>(p);
}
cudaStream_t stream(void* p) {
  return static_cast<cudaStream_t>(p);
}

}  // namespace

PersistentChannel::PersistentChannel(int device, uint32_t blocks, uint32_t slots, uint64_t idle_us,
                                     uint64_t timeout_ms, bool simple, size_t args_bytes,
                                     const uint32_t* failed, const uint64_t* abort_word)
    : device_(device),
      blocks_(blocks),
      simple_(simple),
      args_bytes_(args_bytes),
      mirror_stride_((args_bytes + 63) / 64 * 64),
      eager_slots_(slots > 2 * kEagerSlots ? kEagerSlots : slots / 2),
      idle_ns_(idle_us * 1000),
      failed_(failed),
      abort_word_(abort_word),
      timeout_ms_(timeout_ms),
      slots_(eager_slots_, slots - eager_slots_, args_bytes) {
  static_assert(DescriptorSlots::kMaxGeneration == gpu::kMaxTagGeneration,
                "a slot's generation must fit the op's tag");
  if (slots > (1u << gpu::kTagSlotBits) - 1 || args_bytes > sizeof(gpu::CollectiveArgs))
    throw InvalidArgument("resident: bad descriptor table shape for the resident kernel");
  if (!memops_.available()) {
    throw CommError("resident: RESIDENT_GPU_PERSISTENT=1 needs stream memory operations: " +
                    memops_.why() + "; unset RESIDENT_GPU_PERSISTENT");
  }
  if (idle_us == 0) requireEagerLoading();
  DeviceGuard guard(device);
  RelaxedCapture relaxed;
  try {
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    const int fit = gpu::persistentBlocksPerSm(simple_) * sms;
    if (static_cast<int>(blocks) > fit) {
      throw InvalidArgument("resident: RESIDENT_GPU_PERSISTENT_BLOCKS=" + std::to_string(blocks) +
                            " exceeds the " + std::to_string(fit) +
                            " blocks of the resident kernel this GPU can hold at once");
    }
    checkCuda(cudaMalloc(reinterpret_cast<void**>(&state_), sizeof(gpu::PersistentState)),
              "cudaMalloc of the resident kernel's state");
    checkCuda(cudaMalloc(reinterpret_cast<void**>(&table_), sizeof(gpu::CollectiveArgs) * slots),
              "cudaMalloc of the descriptor table");
    checkCuda(cudaMalloc(reinterpret_cast<void**>(&table_generation_), sizeof(uint32_t) * slots),
              "cudaMalloc of the descriptor table's generations");
    void* host = nullptr;
    checkCuda(cudaHostAlloc(&host, sizeof(gpu::PersistentHostWords),
                            cudaHostAllocMapped | cudaHostAllocPortable),
              "cudaHostAlloc of the resident kernel's host words");
    host_ = static_cast<gpu::PersistentHostWords*>(host);
    std::memset(host_, 0, sizeof(*host_));
    void* dev = nullptr;
    checkCuda(cudaHostGetDevicePointer(&dev, host, 0), "cudaHostGetDevicePointer");
    host_dev_ = static_cast<gpu::PersistentHostWords*>(dev);
    void* mirror = nullptr;
    checkCuda(
        cudaHostAlloc(&mirror, mirror_stride_ * slots, cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc of the descriptor mirror");
    mirror_ = static_cast<unsigned char*>(mirror);
    checkCuda(cudaHostGetDevicePointer(&dev, mirror, 0), "cudaHostGetDevicePointer");
    mirror_dev_ = static_cast<const unsigned char*>(dev);
    // Highest priority: a relaunch should not queue behind ordinary work.
    int least = 0, greatest = 0;
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    checkCuda(cudaStreamCreateWithPriority(asStream(&run_stream_), cudaStreamNonBlocking, greatest),
              "cudaStreamCreate");
    // Zeroed on run_stream_ (the instances run behind it) and waited for on it alone: a
    // device-wide synchronize would wait for other groups' resident kernels.
    checkCuda(cudaMemsetAsync(state_, 0, sizeof(gpu::PersistentState), stream(run_stream_)),
              "initialising the resident kernel's state");
    checkCuda(cudaMemsetAsync(table_generation_, 0, sizeof(uint32_t) * slots, stream(run_stream_)),
              "initialising the resident kernel's state");
    checkCuda(cudaStreamSynchronize(stream(run_stream_)),
              "initialising the resident kernel's state");
    addLive(host_);
    // The thread first: once an instance runs, nothing below may fail (release() would free
    // memory it polls).
    launcher_ = std::thread([this] { launcherLoop(); });
    std::lock_guard<std::timed_mutex> lock(launch_mu_);
    launchLocked();
  } catch (...) {
    stopLauncher();
    release();
    throw;
  }
  RLOG_INFO("resident kernel on device %d: %u blocks, %u descriptor slots, idle exit after %llu us",
            device, blocks, slots, static_cast<unsigned long long>(idle_us));
}

void PersistentChannel::requireEagerLoading() {
  std::string why;
  const ModuleLoading mode = moduleLoading(&why);
  if (mode == ModuleLoading::kLazy) {
    throw InvalidArgument(
        "resident: RESIDENT_GPU_PERSISTENT_IDLE_US=0 keeps the resident kernel on the GPU for "
        "the group's lifetime, but this process loads CUDA kernels lazily "
        "(CUDA_MODULE_LOADING=LAZY, PyTorch's default when unset): the first launch of any "
        "kernel not loaded yet would wait for the resident kernel forever (under MPS it was seen "
        "to fail with an illegal memory access instead). Set CUDA_MODULE_LOADING=EAGER in the "
        "environment before the process starts CUDA, or give RESIDENT_GPU_PERSISTENT_IDLE_US a "
        "value > 0 (such a launch then waits until the kernel idles out)");
  }
  if (mode == ModuleLoading::kUnknown) {
    RLOG_WARN(
        "RESIDENT_GPU_PERSISTENT_IDLE_US=0: cannot tell whether CUDA loads kernels lazily "
        "(%s); if it does, a kernel's first launch waits for the resident kernel forever",
        why.c_str());
  }
}

PersistentChannel::~PersistentChannel() {
  stop();
}

uint32_t PersistentChannel::loadHost(const uint32_t* word) const {
  return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

void PersistentChannel::launchLocked() {
  DeviceGuard guard(device_);
  RelaxedCapture relaxed;
  gpu::PersistentArgs a{};
  a.state = state_;
  a.table = table_;
  a.table_generation = table_generation_;
  a.mirror = mirror_dev_;
  a.mirror_stride = static_cast<uint32_t>(mirror_stride_);
  a.args_bytes = static_cast<uint32_t>(args_bytes_);
  a.host = host_dev_;
  a.failed = failed_;
  a.abort_word = abort_word_;
  a.slots = slots_.size();
  a.generation = launches_.load() + 1;
  a.idle_ns = idle_ns_;
  in_launch_.store(true, std::memory_order_relaxed);
  const cudaError_t err = gpu::launchPersistent(a, blocks_, stream(run_stream_), simple_);
  in_launch_.store(false, std::memory_order_relaxed);
  checkCuda(err, "launching the resident kernel");
  launches_.fetch_add(1);
  RLOG_DEBUG("resident kernel launched (generation %u)", launches_.load());
}

void PersistentChannel::ensureInstance() {
  // An eager op launches the instance it needs itself, before its doorbell, rather than
  // leaving it to the launcher thread: no hand-off latency, and the instance is queued ahead of
  // the op's wait; a launch from another thread blocks inside the driver while the caller sits
  // in a pageable copy on the legacy default stream behind the op (launchPersistent). Dekker
  // with the kernel's `leaving` (nextTag):
  // `issued` was stored before this fence, `leaving` is read after it.
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (instanceStays()) return;  // the common case: no lock
  std::lock_guard<std::timed_mutex> lock(launch_mu_);
  // None runs, or the one that runs is leaving (if it stays after all, this one queues behind
  // it on run_stream_ and takes over when it leaves).
  if (!stopped_ && !instanceStays()) launchLocked();
}

bool PersistentChannel::instanceStays() const {
  const uint32_t n = launches_.load();
  return loadHost(&host_->exits) != n && loadHost(&host_->leaving) != n;
}

bool PersistentChannel::opWaitsForLaunch() const {
  return loadHost(&host_->exits) == launches_.load() && loadHost(&host_->mailbox) != 0;
}

bool PersistentChannel::poll() {
  // The proxy is detached before stop() runs, so host_ stays valid here without a lock.
  polls_.store(polls_.load(std::memory_order_relaxed) + 1,
               std::memory_order_relaxed);  // one writer
  if (stopped_) return false;
  watch();
  // Only while no instance is live (an instance writes `exits` as it leaves, after its last
  // look at the mailbox): an op in the mailbox then waits for a launch. Plain loads only; the
  // proxy thread never waits on a stream, nor on a launch.
  if (!opWaitsForLaunch()) return false;
  {
    std::lock_guard<std::mutex> lock(want_mu_);
    want_launch_ = true;
  }
  want_cv_.notify_one();
  return true;
}

void PersistentChannel::launcherLoop() {
  std::unique_lock<std::mutex> want(want_mu_);
  for (;;) {
    want_cv_.wait(want, [this] { return want_launch_ || launcher_quit_; });
    if (launcher_quit_) return;
    want_launch_ = false;
    want.unlock();
    try {
      std::lock_guard<std::timed_mutex> lock(launch_mu_);
      // Asked for by poll(); still wanted? (a caller's ensureInstance may have launched.)
      if (!stopped_ && opWaitsForLaunch()) launchLocked();
    } catch (const std::exception& e) {
      // The waiting op's stream is released by the watchdog after the timeout.
      RLOG_ERROR("relaunching the resident kernel on device %d failed: %s", device_, e.what());
    }
    want.lock();
  }
}

void PersistentChannel::watch() {
  // An op that waits in the mailbox while the kernel completes nothing for longer than the
  // group timeout (+2 s) was never run: an op stuck on a peer fails on the device at the
  // timeout and leaves the mailbox. Without this, its stream would wait forever.
  // Plain loads on every proxy pass; the clock only while an op waits unserved.
  const uint32_t served = loadHost(&host_->served);
  if (loadHost(&host_->mailbox) == 0 || served != watch_served_) {
    watch_served_ = served;
    watch_since_ = {};
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (watch_since_ == std::chrono::steady_clock::time_point{}) watch_since_ = now;
  if (stuck_set_.load(std::memory_order_relaxed) ||
      now - watch_since_ < std::chrono::milliseconds(timeout_ms_.load() + 2000))
    return;
  const bool live = loadHost(&host_->exits) != launches_;
  const bool began = loadHost(&host_->started) == launches_;
  stuck_ = "resident: the resident kernel (RESIDENT_GPU_PERSISTENT=1) on device " +
           std::to_string(device_) + " did not run an op handed to it within " +
           std::to_string(timeout_ms_.load() + 2000) + " ms (its last instance " +
           (!live ? "had left and was not relaunched"
                  : (began ? "runs but serves nothing" : "is still queued behind other GPU work")) +
           "); the op's stream was released without a result and this process group can no "
           "longer be used";
  stuck_set_.store(true, std::memory_order_release);  // publishes stuck_
  RLOG_ERROR("%s", stuck_.c_str());
  __atomic_store_n(&host_->mailbox, 0u, __ATOMIC_RELEASE);
}

std::string PersistentChannel::stuckError() const {
  return stuck_set_.load(std::memory_order_acquire) ? stuck_ : std::string();
}

void PersistentChannel::waitEagerDone(uint32_t stamp) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
  while (!DescriptorSlots::reached(loadHost(&host_->eager_done), stamp)) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw CommError(
          "resident: a descriptor slot of the resident kernel is still used by an op "
          "that has not completed after " +
          std::to_string(timeout_ms_.load()) + " ms");
    }
    std::this_thread::yield();
  }
}

// Host stores only (see persistent_args.hpp for why no copy to the device); the stream's
// doorbell write, enqueued after them, publishes them to the kernel.
void PersistentChannel::upload(uint32_t slot, const gpu::CollectiveArgs& args) {
  std::memcpy(mirror_ + static_cast<size_t>(slot) * mirror_stride_, &args, args_bytes_);
  std::atomic_thread_fence(std::memory_order_release);
}

void PersistentChannel::enqueue(const gpu::CollectiveArgs& args, void* on, bool captured) {
  DescriptorSlots::Pick pick;
  uint32_t stamp = 0, tag = 0;
  {
    std::lock_guard<std::mutex> lock(table_mu_);
    if (stopped_) throw CommError("resident: the resident kernel was stopped");
    if (captured) {
      pick = slots_.graph(&args, args_bytes_);
    } else {
      // Eager ops in flight are on ONE stream at a time, so that they complete in stamp order:
      // `eager_done` (the last completed stamp) then tells when a slot's last user is done,
      // and whether an issued op is still to come. Switching streams waits for the others.
      if (last_eager_stream_ != nullptr && last_eager_stream_ != on) waitEagerDone(eager_stamp_);
      last_eager_stream_ = on;
      stamp = ++eager_stamp_;
      pick = slots_.eager(&args, args_bytes_, stamp);
    }
    if (pick.must_wait) waitEagerDone(pick.wait_stamp);
    if (pick.upload) upload(pick.slot, args);
    tag = gpu::opTag(pick.slot, pick.generation);
    // Before the doorbell is enqueued: the running instance stays until this op is done.
    if (!captured) __atomic_store_n(&host_->issued, stamp, __ATOMIC_RELEASE);
  }
  if (!captured) ensureInstance();
  const MemOp ops[3] = {{MemOp::kWrite, &host_dev_->mailbox, tag},
                        {MemOp::kWaitEq, &host_dev_->mailbox, 0},
                        {MemOp::kWrite, &host_dev_->eager_done, stamp}};
  const auto err = static_cast<cudaError_t>(memops_.enqueue(on, ops, captured ? 2 : 3));
  if (err != cudaSuccess && !captured) {
    // This op will never complete: stop holding the instance for it.
    __atomic_store_n(&host_->issued, loadHost(&host_->eager_done), __ATOMIC_RELEASE);
  }
  checkCuda(err, "handing an op to the resident kernel (cuStreamBatchMemOp)");
}

void PersistentChannel::askLauncherToQuit() {
  {
    std::lock_guard<std::mutex> want(want_mu_);
    launcher_quit_ = true;
  }
  want_cv_.notify_one();
}

void PersistentChannel::stopLauncher() {
  askLauncherToQuit();
  if (launcher_.joinable()) launcher_.join();
}

void PersistentChannel::stop() {
  askLauncherToQuit();  // no new launch; joined once launch_mu_ is free
  {
    // Both locks: an enqueue either saw stopped_ or had published `issued` (drained below).
    // launch_mu_ is held across a launch; one blocked behind a stream that waits for an op no
    // instance runs ends when that stream is released, so after a grace period the mailbox is
    // cleared (the op is abandoned, as every op in flight at shutdown: it was aborted first).
    std::unique_lock<std::timed_mutex> lock(launch_mu_, std::defer_lock);
    const auto grace = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    while (!lock.try_lock_for(std::chrono::milliseconds(10))) {
      if (host_ != nullptr && std::chrono::steady_clock::now() > grace)
        __atomic_store_n(&host_->mailbox, 0u, __ATOMIC_RELEASE);
    }
    std::lock_guard<std::mutex> table_lock(table_mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  stopLauncher();
  if (host_ == nullptr) return release();
  __atomic_store_n(&host_->quit, 1u, __ATOMIC_RELEASE);
  // An instance leaves after its current op (which the caller aborted first) and at most
  // ~20 us of polling; bounded by the group timeout in case an op is stuck.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_.load() + 2000);
  bool left = true;
  while (loadHost(&host_->exits) != launches_) {
    if (std::chrono::steady_clock::now() > deadline) {
      left = false;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (!left) {
    // Freeing memory a running kernel polls would crash it: leak it instead, loudly.
    RLOG_ERROR("the resident kernel on device %d did not leave; its memory is not released",
               device_);
    removeLive(host_);
    return;
  }
  {
    DeviceGuard guard(device_);
    cudaStreamSynchronize(stream(run_stream_));
  }
  // No instance runs now and none is launched again: an op still in the mailbox (a stream
  // handed it over after the last instance looked) would hold its stream forever. Release
  // such streams (the op is abandoned: its Work reports the shutdown) until every eager op
  // handed to a stream passed its hand-off, bounded by the group timeout; the words they
  // touch are freed only then.
  bool drained = false;
  while (true) {
    __atomic_store_n(&host_->mailbox, 0u, __ATOMIC_RELEASE);
    drained = loadHost(&host_->eager_done) == loadHost(&host_->issued);
    if (drained || std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (!drained) {
    RLOG_ERROR(
        "an op handed to the resident kernel on device %d never reached its stream's "
        "hand-off; the kernel's memory is not released",
        device_);
    removeLive(host_);
    return;
  }
  release();
}

void PersistentChannel::release() {
  DeviceGuard guard(device_);
  gpu::PersistentHostWords* host = nullptr;
  {
    // status() reads the host words under table_mu_ (from any thread): they go away under it.
    std::lock_guard<std::mutex> lock(table_mu_);
    host = host_;
    host_ = host_dev_ = nullptr;
  }
  if (host != nullptr) {
    removeLive(host);
    cudaFreeHost(host);
  }
  if (run_stream_ != nullptr) cudaStreamDestroy(stream(run_stream_));
  if (mirror_ != nullptr) cudaFreeHost(mirror_);
  if (table_generation_ != nullptr) cudaFree(table_generation_);
  if (table_ != nullptr) cudaFree(table_);
  if (state_ != nullptr) cudaFree(state_);
  run_stream_ = nullptr;
  mirror_ = nullptr;
  mirror_dev_ = nullptr;
  table_generation_ = nullptr;
  table_ = nullptr;
  state_ = nullptr;
}

PersistentStatus PersistentChannel::status() const {
  PersistentStatus s;
  // No launch_mu_: a status read (a stuck op's diagnostics) must not wait for a relaunch.
  s.blocks = blocks_;
  s.polls = polls_.load(std::memory_order_relaxed);
  s.in_launch = in_launch_.load(std::memory_order_relaxed);
  s.slots = slots_.size();
  std::lock_guard<std::mutex> table_lock(table_mu_);
  if (host_ == nullptr) return s;
  s.launches = launches_.load();
  s.exits = loadHost(&host_->exits);
  const bool live = s.exits != s.launches;
  const bool began = loadHost(&host_->started) == s.launches;
  s.running = live && began;
  s.queued = live && !began;
  s.served = loadHost(&host_->served);
  s.mailbox = loadHost(&host_->mailbox);
  s.issued = loadHost(&host_->issued);
  s.eager_done = loadHost(&host_->eager_done);
  s.graph_slots_used = slots_.graphSlotsUsed();
  return s;
}

}  // namespace resident
