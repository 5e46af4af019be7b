// The CUDA path's communicator: set-up (the peers' segments mapped for the device, the proxy
// outbox, the device state, the Region every launch copies), the proxy's CPU placement,
// shutdown, and the device-side error status. How ops become launches:
// gpu_communicator_ops.cpp; the proxy side: gpu_communicator_proxy.cpp.
#include "cuda/gpu_communicator.hpp"

#include <cuda_runtime.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

#include "collective_launch.hpp"
#include "core/clock.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "cuda/cuda_guards.hpp"
#include "ep_args.hpp"
#include "region_offsets.cuh"
#include "rounds_device.cuh"

namespace resident {

const char* GpuCommunicator::opName(uint32_t id) {
  static const char* kNames[] = {"all_reduce",
                                 "reduce_scatter",
                                 "reduce",
                                 "all_gather",
                                 "gather",
                                 "scatter",
                                 "all_to_all",
                                 "broadcast",
                                 "send",
                                 "recv",
                                 "all_to_all (device splits)"};
  return id < sizeof(kNames) / sizeof(kNames[0]) ? kNames[id] : "op";
}

namespace {

static_assert(GpuLayout::kPeersLeftBits >= gpu::kMaxRanks,
              "the left-peer word needs a bit per rank of a CUDA group");

// The word a kernel that gave up writes (Waiter::shouldStop, kernels/ll_device.cuh):
// code | op << 8 | (peer + 1) << 16 | what << 32 | expected << 40; 0: no error.
struct KernelError {
  gpu::ErrorCode code;
  uint32_t op;
  int peer;  // -1: none
  uint32_t what;
  uint64_t expected;
};
KernelError decodeKernelError(uint64_t word) {
  return {static_cast<gpu::ErrorCode>(word & 0xff), static_cast<uint32_t>(word >> 8) & 0xff,
          static_cast<int>((word >> 16) & 0xffff) - 1, static_cast<uint32_t>(word >> 32) & 0xff,
          word >> 40};
}

std::vector<int> parseCpuList(const std::string& text) {
  std::vector<int> cpus;
  size_t i = 0;
  while (i < text.size()) {
    size_t end = text.find(',', i);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(i, end - i);
    const size_t dash = item.find('-');
    if (!item.empty() && item[0] >= '0' && item[0] <= '9') {
      const int lo = std::atoi(item.c_str());
      const int hi = dash == std::string::npos ? lo : std::atoi(item.c_str() + dash + 1);
      for (int c = lo; c <= hi; ++c) cpus.push_back(c);
    }
    i = end + 1;
  }
  return cpus;
}

// Every kernel of the library loaded before a device's first op of the process: under lazy
// module loading (CUDA's default) a first launch may wait for the context's running kernels,
// such as a recv spinning for a peer whose own first launch of some kernel waits in turn
// (collective_launch.hpp). Every instantiation, the EP kernels' included: any first launch can
// be the one that waits. Once per device, before any of our kernels can be running there.
void loadKernelsOnce(int device) {
  static std::mutex mu;
  static std::set<int> loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (loaded.count(device) != 0) return;
  checkCuda(gpu::loadCollectiveKernels(), "loading the collective kernels");
  checkCuda(gpu::loadSplitsKernels(), "loading the device-splits all_to_all kernels");
  checkCuda(gpu::loadOneRoundKernels(), "loading the one-round kernels");
  checkCuda(gpu::loadP2PKernels(), "loading the send/recv kernels");
  const std::string ep = ep::loadKernels();
  if (!ep.empty()) throw CommError("resident: loading the EP kernels: " + ep);
  loaded.insert(device);
}

// The device state's first contents, landed before any stream can read them: a plain
// cudaMemcpy from pageable memory may return before the copy completes, ordered only on the
// legacy default stream, while a first op may run on a non-blocking stream (a send/recv's
// own). A stream of its own, not a device-wide synchronize, which would wait for the kernels
// of other groups of the process (a kernel waiting for a peer, for one).
void writeDeviceState(gpu::DeviceState* dst, const gpu::DeviceState& src) {
  cudaStream_t s = nullptr;
  checkCuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaError_t err = cudaMemcpyAsync(dst, &src, sizeof(src), cudaMemcpyHostToDevice, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  checkCuda(err, "writing the device state");
}

}  // namespace

GpuCommunicator::GpuCommunicator(Communicator& comm, int device, uint64_t timeout_ms)
    : comm_(comm), rank_(comm.rank()), nranks_(comm.size()), device_(device) {
  if (nranks_ > gpu::kMaxRanks) {
    throw InvalidArgument("resident: CUDA tensors are supported in groups of at most " +
                          std::to_string(gpu::kMaxRanks) + " ranks; this group has " +
                          std::to_string(nranks_));
  }
  const GpuLayout& lay = comm.gpuLayout();
  const size_t needed = comm.gpuRegionOffset() + lay.totalBytes();
  if (comm.segmentBytes() < needed) {
    throw InvalidArgument(
        "resident: this group was created without a GPU region (CUDA was not available in the "
        "process when the group was created); create the group after CUDA is usable");
  }
  DeviceGuard guard(device);
  RelaxedCapture relaxed;
  auto registerMapped = [&](unsigned char* base, size_t bytes, int owner) -> unsigned char* {
    checkCuda(cudaHostRegister(base, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
              "cudaHostRegister of a shared segment");
    registered_.push_back(base);
    void* dev = nullptr;
    checkCuda(cudaHostGetDevicePointer(&dev, base, 0), "cudaHostGetDevicePointer");
    RLOG_DEBUG("rank %d: segment of rank %d registered for device %d", rank_, owner, device);
    return static_cast<unsigned char*>(dev) + comm.gpuRegionOffset();
  };
  host_rounds_ = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(nranks_));
  try {
    gpu::DeviceState host_state{};
    region_.local = registerMapped(comm.segmentBase(), comm.segmentBytes(), rank_);
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      if (comm.pairProxied(p)) region_.proxy_rule |= 1ull << p;
      if (comm.proxied(p)) {
        any_proxied_ = true;
        region_.proxied |= 1ull << p;
        if (comm.transport().fusesLineCheck(p))
          fused_peers_ |= 1ull << p;
        else
          region_.network_rule |= 1ull << p;  // the same transport both ways: both ends agree
        continue;
      }
      if (comm.peerSegmentBytes(p) < needed) {
        throw CommError("resident: rank " + std::to_string(p) +
                        " has no GPU region in its segment (was CUDA unavailable there?)");
      }
      host_state.remote[p] = registerMapped(comm.peerSegment(p), comm.peerSegmentBytes(p), p);
    }
    if (any_proxied_) {
      void* out = nullptr;
      checkCuda(cudaHostAlloc(&out, lay.outboxBytes(), cudaHostAllocMapped | cudaHostAllocPortable),
                "cudaHostAlloc of the proxy outbox");
      outbox_host_ = static_cast<unsigned char*>(out);
      std::memset(outbox_host_, 0, lay.outboxBytes());  // credit words included (as sent)
      credit_sent_.assign(static_cast<size_t>(nranks_), {});
      credit_seen_ns_.assign(static_cast<size_t>(nranks_), {});
      last_write_ns_.assign(static_cast<size_t>(nranks_), 0);
      void* dev = nullptr;
      checkCuda(cudaHostGetDevicePointer(&dev, out, 0), "cudaHostGetDevicePointer (outbox)");
      region_.outbox = static_cast<unsigned char*>(dev);
      // A kernel rewrites an outbox slot only after the peer answered the round it carried, so
      // a network transport may send straight from it (ib: no copy into its staging ring).
      const bool sent_in_place = comm.transport().registerSource(outbox_host_, lay.outboxBytes());
      RLOG_DEBUG("rank %d: proxy outbox %s", rank_,
                 sent_in_place ? "registered with the transport (sent in place)"
                               : "copied by the transport");
      if (!comm.config().gpu_proxy_trace.empty()) {
        trace_ = std::make_unique<ProxyTrace>(size_t{1} << 21);  // 48 MiB: opt-in only
        const size_t stamp_bytes =
            sizeof(unsigned long long) * gpu::kStampOps * 2 * gpu::kStampsPerBlock;
        checkCuda(cudaMalloc(reinterpret_cast<void**>(&stamps_), stamp_bytes),
                  "cudaMalloc of the kernel timeline (RESIDENT_GPU_PROXY_TRACE)");
        checkCuda(cudaMemset(stamps_, 0, stamp_bytes), "cudaMemset of the kernel timeline");
      }
    }
    startRoundsAt(comm.config().gpu_first_round, host_state);
    checkCuda(cudaMalloc(reinterpret_cast<void**>(&state_), sizeof(gpu::DeviceState)),
              "cudaMalloc of the device state");
    writeDeviceState(state_, host_state);
    loadKernelsOnce(device);
  } catch (...) {
    shutdown();
    throw;
  }
  region_.state = state_;
  region_.stamps = stamps_;
  gpu::setRegionLayout(region_, lay);
  region_.timeout_ns = timeout_ms * 1000000ull;
  timeout_ns_.store(region_.timeout_ns, std::memory_order_relaxed);
  // simplePair's thresholds: direct pairs above kDirectSimpleAbove with
  // RESIDENT_GPU_PROTOCOL=simple; pairs proxied over shm above kProxySimpleAbove, over a network
  // above kNetworkSimpleAbove; each capped at half a chunk (above that an op's LL lines would
  // reach the slot's simple payload half, simple_device.cuh).
  const Config& cfg = comm.config();
  region_.simple_above[0] = cfg.gpu_protocol == GpuProtocol::kSimple
                                ? std::min(kDirectSimpleAbove, lay.chunk / 2)
                                : gpu::kSimpleNever;
  region_.simple_above[1] = std::min(kProxySimpleAbove, lay.chunk / 2);
  region_.simple_above[2] = std::min(kNetworkSimpleAbove, lay.chunk / 2);
  // Could any op be simple? Then the residency budget below is that of the heavier build.
  // (Region::simple itself is set per op, in launchCollective.)
  bool simple_possible = false;
  for (int p = 0; p < nranks_; ++p)
    simple_possible |=
        p != rank_ && region_.simple_above[gpu::pairRule(region_, p)] != gpu::kSimpleNever;
  unsigned char* gpu_base = comm.segmentBase() + comm.gpuRegionOffset();
  ring_ = TriggerRingView(gpu_base + lay.fifoOffset(),
                          reinterpret_cast<uint64_t*>(gpu_base + GpuLayout::kFifoTailWord),
                          GpuLayout::kFifoCapacity);
  // Ranks of this host share its GPUs: assume they spread evenly over the visible devices.
  int sms = 0, devices = 1;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaGetDeviceCount(&devices);
  int local_ranks = 0;
  for (int p = 0; p < nranks_; ++p) local_ranks += comm.sameHost(p) ? 1 : 0;
  const int per_gpu = (local_ranks + devices - 1) / (devices > 0 ? devices : 1);
  const int capacity = gpu::residentBlocksPerSm(simple_possible) * sms;
  // Per rank: a collective kernel and its PDL successor (2 x max_blocks_), plus p2p kernels
  // on up to 2(n-1) streams that share another 2 x max_blocks_ (see launchP2P): 4 x
  // max_blocks_ per rank, so every rank sharing the GPU stays resident at once.
  auto fairShare = [&](int blocks_on_gpu) {
    const int fair = blocks_on_gpu / (4 * std::max(per_gpu, 1));
    return static_cast<uint32_t>(std::min(std::max(fair, 1), static_cast<int>(gpu::kMaxBlocks)));
  };
  max_blocks_ = fairShare(capacity);
  if (cfg.gpu_max_blocks != 0 && cfg.gpu_max_blocks < max_blocks_) max_blocks_ = cfg.gpu_max_blocks;
  // The device-splits all_to_all keeps its plan in shared memory: its own budget by the same
  // rule, never above the collectives'.
  split_max_blocks_ =
      std::min(max_blocks_, fairShare(gpu::splitsBlocksPerSm(simple_possible) * sms));
  RLOG_INFO("rank %d: %d SMs, %d resident blocks, %d ranks per GPU -> at most %u blocks per op",
            rank_, sms, capacity, per_gpu, max_blocks_);
  comm.setExtraPoller(this);
  if (any_proxied_ && comm.proxy() != nullptr) {
    comm.proxy()->setSpinUs(comm.config().gpu_proxy_spin_us);
    if (comm.config().proxy_cpu < 0) pinProxyNearDevice();
  }
  RLOG_INFO("rank %d: CUDA path on device %d installed (%s)", rank_, device,
            any_proxied_ ? "proxy peers present" : "direct");
}

void GpuCommunicator::startRoundsAt(uint32_t first, gpu::DeviceState& state) {
  if (first == 0) return;  // zeroed memory already says so
  // The device-splits header mark (an op's first round with its reference peer + 1): one that
  // the first op's cannot equal.
  state.splits_header = first;
  // Every channel's round number, and what the send side knows of the receiver's credits: the
  // receiver has consumed every round up to `first` (p2p_kernel.cu's waitCredit), in the
  // device's cache, in this rank's credit words that peers write and, proxied, in the outbox
  // words the proxy forwards and in its record of what it sent.
  const GpuLayout& lay = comm_.gpuLayout();
  unsigned char* region = comm_.segmentBase() + comm_.gpuRegionOffset();
  for (int p = 0; p < nranks_; ++p) {
    state.coll_round[p] = state.p2p_send_round[p] = state.p2p_recv_round[p] = first;
    auto* credit_in = reinterpret_cast<uint64_t*>(region + lay.creditIn(p));
    for (uint32_t slot = 0; slot < GpuLayout::kP2PSlots; ++slot) {
      state.p2p_credit[p][slot] = first;
      credit_in[slot] = first;
      if (outbox_host_ == nullptr) continue;
      reinterpret_cast<uint64_t*>(outbox_host_ + lay.outCredit(p))[slot] = first;
      credit_sent_[static_cast<size_t>(p)][slot] = first;
    }
  }
}

GpuCommunicator::~GpuCommunicator() {
  shutdown();
}

void GpuCommunicator::pinProxyNearDevice() {
  char bus[64] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device_) != cudaSuccess) return;
  for (char* c = bus; *c; ++c) *c = static_cast<char>(std::tolower(*c));
  std::string list;
  const std::string path = std::string("/sys/bus/pci/devices/") + bus + "/local_cpulist";
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[512] = {0};
    if (std::fgets(buf, sizeof(buf), f) != nullptr) list = buf;
    std::fclose(f);
  }
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return;
  std::vector<int> near;
  for (int c : parseCpuList(list))
    if (c < CPU_SETSIZE && CPU_ISSET(c, &allowed)) near.push_back(c);
  if (near.empty()) {  // no NUMA information: any allowed CPU
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &allowed)) near.push_back(c);
  }
  if (near.size() < 2) return;  // pinning to the only core would starve the caller
  // Spread the proxies of this host's ranks from the top of the list down (callers tend to
  // start on low CPUs).
  const int cpu = near[near.size() - 1 - static_cast<size_t>(comm_.localIndex()) % near.size()];
  if (comm_.proxy()->pin(cpu))
    RLOG_INFO("rank %d: proxy pinned to cpu %d near GPU %s", rank_, cpu, bus);
}

void GpuCommunicator::shutdown() {
  if (shut_down_) return;
  // A Work may outlive its group and ask for its error after the segments are gone.
  if (region_.local != nullptr) final_error_ = deviceError();
  drainTriggers();
  shut_down_ = true;
  // Abort first: a proxy pass waiting for lines of a kernel that stopped ends on the abort word,
  // so detaching the proxy (which waits until it is outside proxyPoll) cannot hang on it.
  if (region_.local != nullptr) abortKernels();
  comm_.setExtraPoller(nullptr);                       // waits until the proxy is outside proxyPoll
  if (outbox_host_ != nullptr) comm_.releaseSource();  // nothing queued from it stays behind
  if (trace_) writeTrace();
  if (region_.local != nullptr) {
    // Kernels of this communicator exit once they see the abort word; wait for them before
    // the memory they write goes away.
    DeviceGuard guard(device_);
    cudaDeviceSynchronize();
    if (stamps_ != nullptr) writeKernelStamps();
  }
  for (void* base : registered_) cudaHostUnregister(base);
  registered_.clear();
  if (outbox_host_ != nullptr) cudaFreeHost(outbox_host_);
  outbox_host_ = nullptr;
  if (state_ != nullptr) cudaFree(state_);
  state_ = nullptr;
  if (stamps_ != nullptr) cudaFree(stamps_);
  stamps_ = nullptr;
}

void GpuCommunicator::drainTriggers() {
  // A peer's last op may still wait on this rank's share of it: without the drain, a rank that
  // destroys its group right after its last op (its kernel done, the proxy not yet past its
  // triggers) leaves the peers waiting until their timeout. Not for a failed group (nothing
  // more reaches the peers), and bounded: a kernel still running may never push what it
  // announced (the abort word below then ends it).
  if (!any_proxied_ || comm_.proxy() == nullptr || region_.local == nullptr ||
      comm_.engine().poisoned() || comm_.engine().anyPeerFailed())
    return;
  const uint64_t deadline = nowNs() + kDrainNs;
  while (ring_.readyBeyondPublished()) {
    if (nowNs() > deadline) {
      RLOG_WARN("rank %d: the proxy did not forward every trigger within %llu ms of shutdown",
                rank_, static_cast<unsigned long long>(kDrainNs / 1000000));
      return;
    }
    comm_.proxy()->wake();  // it may be in a standby sleep
    sched_yield();          // its core may be this one
  }
}

void GpuCommunicator::writeTrace() {
  static std::atomic<int> serial{0};
  trace_serial_ = trace_->save(comm_.config().gpu_proxy_trace, rank_, serial, ".tsv");
  trace_.reset();
}

void GpuCommunicator::writeKernelStamps() {
  // <prefix>.rank<r>.<n>.gpu.tsv beside the proxy's <n>.tsv: per op and block (0: first, 1:
  // last) the StampPoints' times, ops in the buffer's order (their round numbers modulo
  // kStampOps; an op no kernel stamped is left out).
  std::vector<unsigned long long> t(size_t{gpu::kStampOps} * 2 * gpu::kStampsPerBlock);
  if (trace_serial_ < 0 ||
      cudaMemcpy(t.data(), stamps_, t.size() * sizeof(t[0]), cudaMemcpyDeviceToHost) != cudaSuccess)
    return;
  const std::string path =
      traceFilePath(comm_.config().gpu_proxy_trace, rank_, trace_serial_, ".gpu.tsv");
  writeTraceFile(rank_, path, [&](FILE* f) {
    std::fprintf(f, "# op\tblock\twaited\tsent\tflags\treceived\texit (ns, %%globaltimer)\n");
    for (size_t row = 0; row < t.size() / gpu::kStampsPerBlock; ++row) {
      const unsigned long long* s = &t[row * gpu::kStampsPerBlock];
      if (s[gpu::kStampWaited] == 0) continue;
      std::fprintf(f, "%zu\t%zu", row / 2, row % 2);
      for (uint32_t k = gpu::kStampWaited; k <= gpu::kStampExit; ++k)
        std::fprintf(f, "\t%llu", s[k]);
      std::fprintf(f, "\n");
    }
  });
}

void GpuCommunicator::abortKernels() {
  unsigned char* gpu_base = comm_.segmentBase() + comm_.gpuRegionOffset();
  __atomic_store_n(reinterpret_cast<uint64_t*>(gpu_base + GpuLayout::kAbortWord), 1ull,
                   __ATOMIC_RELEASE);
}

uint64_t GpuCommunicator::deviceErrorWord() const {
  const unsigned char* gpu_base = comm_.segmentBase() + comm_.gpuRegionOffset();
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(gpu_base + GpuLayout::kErrorWord),
                         __ATOMIC_ACQUIRE);
}

bool GpuCommunicator::deviceTimedOut() const {
  return !shut_down_ && decodeKernelError(deviceErrorWord()).code == gpu::ErrorCode::kTimeout;
}

std::string GpuCommunicator::deviceError() const {
  if (shut_down_) return final_error_;
  const uint64_t word = deviceErrorWord();
  if (word == 0) return {};
  const KernelError e = decodeKernelError(word);
  static const char* const kWhat[] = {"",
                                      " (a line with flag ",
                                      " (a word of value ",
                                      " (a flag of value ",
                                      " (room in the trigger FIFO at ",
                                      " (a credit for round "};
  const std::string waited =
      e.what > 0 && e.what < 6 ? kWhat[e.what] + std::to_string(e.expected) + ")" : std::string();
  std::string msg = std::string("resident: a CUDA ") + opName(e.op) + " on " +
                    comm_.rankName(rank_) + " gave up waiting for " + comm_.rankName(e.peer) +
                    waited;
  if (e.code == gpu::ErrorCode::kTimeout)
    msg += ": timed out on the device after " +
           std::to_string(timeout_ns_.load(std::memory_order_relaxed) / 1000000) +
           " ms (the peer is dead, stuck, or called a different op)";
  else if (e.code == gpu::ErrorCode::kPeerLeft)
    msg += ": " + comm_.rankName(e.peer) +
           " destroyed its process group (or exited) before its part of this op came (the ranks "
           "called a different number of ops, or it left with this op in flight)";
  else if (comm_.engine().poisoned())
    msg += ": " + comm_.engine().poisonReason();
  else
    msg += ": the process group was aborted or shut down";
  return msg + "; this process group can no longer be used";
}

std::string GpuCommunicator::deviceErrorFailingGroup() const {
  std::string err = deviceError();
  if (!err.empty() && !shut_down_ && !comm_.engine().poisoned()) failGroup(err);
  return err;
}

void GpuCommunicator::failGroup(const std::string& err) const {
  // A peer that left is the cause the peers are told (Communicator::failedState), set first.
  const KernelError e = decodeKernelError(deviceErrorWord());
  if (e.code == gpu::ErrorCode::kPeerLeft) comm_.engine().noteLeftPeerNeeded(e.peer);
  comm_.engine().poison(
      err, e.code == gpu::ErrorCode::kTimeout ? ErrorKind::kTimeout : ErrorKind::kComm);
}

void GpuCommunicator::checkUsable() const {
  if (shut_down_) throw CommError("resident: the process group was shut down");
  const std::string err = deviceErrorFailingGroup();
  if (!err.empty()) throw CommError(err);
  if (comm_.engine().poisoned())
    throw CommError("resident: the process group is unusable after an earlier error: " +
                    comm_.engine().poisonReason());
}

}  // namespace resident
