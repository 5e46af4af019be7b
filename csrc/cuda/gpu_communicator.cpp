#include "cuda/gpu_communicator.hpp"

#include <cuda_runtime.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

#include "collective_launch.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/trigger_encoding.hpp"
#include "cuda/cuda_guards.hpp"
#include "region_offsets.cuh"
#include "rounds_device.cuh"

namespace resident {
namespace {

static_assert(static_cast<int>(DType::kUInt8) == 6 && static_cast<int>(RedOp::kBXor) == 7,
              "kernels/reduce_device.cuh mirrors the DType and RedOp codes");

bool capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  checkCuda(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status),
            "cudaStreamIsCapturing");
  return status == cudaStreamCaptureStatusActive;
}

const char* opName(uint32_t id) {
  static const char* kNames[] = {
      "all_reduce", "reduce_scatter", "reduce",    "all_gather", "gather",
      "scatter",    "all_to_all",     "broadcast", "send",       "recv"};
  return id < sizeof(kNames) / sizeof(kNames[0]) ? kNames[id] : "op";
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

// Every kernel loaded before a device's first op of the process: under lazy module loading
// (CUDA's default) a first launch may wait for the context's running kernels, such as a recv
// spinning for that very launch's peer (collective_launch.hpp). Once per device, before any of
// our kernels can be running there (the collective and persistent kernels are loaded by
// their occupancy queries).
void loadKernelsOnce(int device) {
  static std::mutex mu;
  static std::set<int> loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (loaded.count(device) != 0) return;
  checkCuda(gpu::loadP2PKernels(), "loading the send/recv kernels");
  loaded.insert(device);
}

// The device state's first contents, landed before any stream can read them: a plain
// cudaMemcpy from pageable memory may return before the copy completes, ordered only on the
// legacy default stream, while a first op may run on a non-blocking stream (a send/recv's
// own). A stream of its own, not a device-wide synchronize, which would wait for the kernels
// of other groups of the process (a resident kernel waiting for a peer, for one).
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
    : comm_(comm),
      rank_(comm.rank()),
      nranks_(comm.size()),
      device_(device),
      pdl_(comm.config().gpu_pdl),
      prefetch_(comm.config().gpu_prefetch),
      one_round_(comm.config().gpu_one_round),
      proxy_streaming_(comm.config().gpu_proxy_streaming),
      proxy_prefetch_(comm.config().gpu_proxy_prefetch_bytes),
      fence_from_(comm.config().gpu_trigger_fence_from) {
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
  const bool fused_check = comm.config().gpu_proxy_fused_check && proxy_streaming_;
  auto registerMapped = [&](unsigned char* base, size_t bytes, int owner) -> unsigned char* {
    checkCuda(cudaHostRegister(base, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
              "cudaHostRegister of a shared segment");
    registered_.push_back(base);
    void* dev = nullptr;
    checkCuda(cudaHostGetDevicePointer(&dev, base, 0), "cudaHostGetDevicePointer");
    RLOG_DEBUG("rank %d: segment of rank %d registered for device %d", rank_, owner, device);
    return static_cast<unsigned char*>(dev) + comm.gpuRegionOffset();
  };
  try {
    gpu::DeviceState host_state{};
    region_.local = registerMapped(comm.segmentBase(), comm.segmentBytes(), rank_);
    for (int p = 0; p < nranks_; ++p) {
      if (p == rank_) continue;
      if (comm.pairProxied(p)) region_.proxy_rule |= 1ull << p;
      if (comm.proxied(p)) {
        any_proxied_ = true;
        region_.proxied |= 1ull << p;
        if (fused_check && comm.transport().fusesLineCheck(p)) fused_peers_ |= 1ull << p;
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
      void* dev = nullptr;
      checkCuda(cudaHostGetDevicePointer(&dev, out, 0), "cudaHostGetDevicePointer (outbox)");
      region_.outbox = static_cast<unsigned char*>(dev);
      // A kernel rewrites an outbox slot only after the peer answered the round it carried, so
      // a network transport may send straight from it (ib: no copy into its staging ring).
      const bool sent_in_place = comm.transport().registerSource(outbox_host_, lay.outboxBytes());
      RLOG_DEBUG("rank %d: proxy outbox %s", rank_,
                 sent_in_place ? "registered with the transport (sent in place)"
                               : "copied by the transport");
      if (!comm.config().gpu_proxy_trace.empty())
        trace_ = std::make_unique<ProxyTrace>(size_t{1} << 21);  // 48 MiB: opt-in only
    }
    checkCuda(cudaMalloc(reinterpret_cast<void**>(&state_), sizeof(gpu::DeviceState)),
              "cudaMalloc of the device state");
    writeDeviceState(state_, host_state);
    loadKernelsOnce(device);
  } catch (...) {
    shutdown();
    throw;
  }
  region_.state = state_;
  gpu::setRegionLayout(region_, lay);
  region_.timeout_ns = timeout_ms * 1000000ull;
  timeout_ns_.store(region_.timeout_ns, std::memory_order_relaxed);
  region_.trigger_fence = comm.config().gpu_trigger_fence ? 1u : 0u;
  // simplePair's thresholds: direct pairs above half a chunk with RESIDENT_GPU_PROTOCOL=simple;
  // proxied ones above RESIDENT_GPU_PROXY_SIMPLE_ABOVE, capped at half a chunk (above that an
  // op's LL lines would reach the slot's simple payload half, simple_device.cuh).
  const Config& cfg = comm.config();
  region_.simple_above[0] = cfg.gpu_protocol_simple ? lay.chunk / 2 : gpu::kSimpleNever;
  const uint32_t proxy_above = cfg.gpu_proxy_simple_above;
  region_.simple_above[1] =
      proxy_above == kGpuSimpleNever ? gpu::kSimpleNever : std::min(proxy_above, lay.chunk / 2);
  // Could any op be simple? Then the kernels that must take any op (the resident kernel) are
  // built with it, and the residency budget below is that of the heavier build. (Region::simple
  // itself is set per op, in launchCollective.)
  bool simple_possible = false;
  for (int p = 0; p < nranks_; ++p)
    simple_possible |=
        p != rank_ && region_.simple_above[(region_.proxy_rule >> p) & 1] != gpu::kSimpleNever;
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
  const int resident_blocks = cfg.gpu_persistent ? static_cast<int>(cfg.gpu_persistent_blocks) : 0;
  // What the resident kernels of the ranks sharing this GPU hold for their lifetime.
  const int capacity = gpu::residentBlocksPerSm(simple_possible) * sms - resident_blocks * per_gpu;
  // Per rank: a collective kernel and its PDL successor (2 x max_blocks_), plus p2p kernels
  // on up to 2(n-1) streams that share another 2 x max_blocks_ (see launchP2P): 4 x
  // max_blocks_ per rank, so every rank sharing the GPU stays resident at once.
  const int fair = capacity / (4 * (per_gpu > 0 ? per_gpu : 1));
  max_blocks_ =
      static_cast<uint32_t>(fair < 1 ? 1 : (fair > gpu::kMaxBlocks ? gpu::kMaxBlocks : fair));
  if (cfg.gpu_max_blocks != 0 && cfg.gpu_max_blocks < max_blocks_) max_blocks_ = cfg.gpu_max_blocks;
  RLOG_INFO("rank %d: %d SMs, %d resident blocks, %d ranks per GPU -> at most %u blocks per op",
            rank_, sms, capacity, per_gpu, max_blocks_);
  persistent_graphs_ = cfg.gpu_persistent_graphs_resident;
  if (cfg.gpu_persistent) {
    try {
      DeviceGuard guard(device);
      RelaxedCapture relaxed;
      persistent_ = std::make_unique<PersistentChannel>(
          device, cfg.gpu_persistent_blocks, cfg.gpu_persistent_slots, cfg.gpu_persistent_idle_us,
          timeout_ms, simple_possible,
          // A descriptor's meaningful bytes: the header and this group's peers.
          offsetof(gpu::CollectiveArgs, peers) +
              static_cast<size_t>(nranks_) * sizeof(gpu::PeerPlan),
          &state_->failed,
          reinterpret_cast<const uint64_t*>(region_.local + GpuLayout::kAbortWord));
    } catch (...) {
      shutdown();
      throw;
    }
  }
  comm.setExtraPoller(this);
  if (any_proxied_ && comm.proxy() != nullptr) {
    comm.proxy()->setSpinUs(comm.config().gpu_proxy_spin_us);
    if (comm.config().proxy_cpu < 0) pinProxyNearDevice();
  }
  RLOG_INFO("rank %d: CUDA path on device %d installed (%s)", rank_, device,
            any_proxied_ ? "proxy peers present" : "direct");
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
  shut_down_ = true;
  // Abort first: a proxy pass waiting for lines of a kernel that stopped ends on the abort word,
  // so detaching the proxy (which waits until it is outside proxyPoll) cannot hang on it.
  if (region_.local != nullptr) abortKernels();
  comm_.setExtraPoller(nullptr);  // waits until the proxy is outside proxyPoll
  if (trace_) writeTrace();
  if (region_.local != nullptr) {
    // The resident kernel leaves after its current op (aborted above); then the one-op
    // kernels are waited for below. Stopped, not destroyed: other threads may still read its
    // status or stuck error (persistent_ lives as long as this communicator).
    if (persistent_) persistent_->stop();
    // Kernels of this communicator exit once they see the abort word; wait for them before
    // the memory they write goes away.
    DeviceGuard guard(device_);
    cudaDeviceSynchronize();
  }
  for (void* base : registered_) cudaHostUnregister(base);
  registered_.clear();
  if (outbox_host_ != nullptr) cudaFreeHost(outbox_host_);
  outbox_host_ = nullptr;
  if (state_ != nullptr) cudaFree(state_);
  state_ = nullptr;
}

void GpuCommunicator::writeTrace() {
  static std::atomic<int> serial{0};  // several groups of one process get files of their own
  const std::string path = comm_.config().gpu_proxy_trace + ".rank" + std::to_string(rank_) + "." +
                           std::to_string(serial++) + ".tsv";
  if (trace_->writeTsv(path))
    RLOG_INFO("rank %d: proxy trace written to %s", rank_, path.c_str());
  else
    RLOG_WARN("rank %d: could not write the proxy trace to %s", rank_, path.c_str());
  trace_.reset();
}

std::optional<PersistentStatus> GpuCommunicator::persistentStatus() const {
  if (!persistent_) return std::nullopt;
  return persistent_->status();
}

void GpuCommunicator::abortKernels() {
  unsigned char* gpu_base = comm_.segmentBase() + comm_.gpuRegionOffset();
  __atomic_store_n(reinterpret_cast<uint64_t*>(gpu_base + GpuLayout::kAbortWord), 1ull,
                   __ATOMIC_RELEASE);
}

std::string GpuCommunicator::deviceError() const {
  if (shut_down_) return final_error_;
  if (persistent_) {
    std::string stuck = persistent_->stuckError();
    if (!stuck.empty()) return stuck;
  }
  const unsigned char* gpu_base = comm_.segmentBase() + comm_.gpuRegionOffset();
  const uint64_t word = __atomic_load_n(
      reinterpret_cast<const uint64_t*>(gpu_base + GpuLayout::kErrorWord), __ATOMIC_ACQUIRE);
  if (word == 0) return {};
  const auto code = static_cast<gpu::ErrorCode>(word & 0xff);
  const uint32_t op = (word >> 8) & 0xff;
  const int64_t peer = static_cast<int64_t>(word >> 16) - 1;
  std::string msg = std::string("resident: a CUDA ") + opName(op) + " on rank " +
                    std::to_string(rank_) + " gave up waiting for rank " + std::to_string(peer);
  if (code == gpu::ErrorCode::kTimeout)
    msg += ": timed out on the device after " +
           std::to_string(timeout_ns_.load(std::memory_order_relaxed) / 1000000) +
           " ms (the peer is dead, stuck, or called a different op)";
  else
    msg += ": the process group was aborted or shut down";
  return msg + "; this process group can no longer be used";
}

void GpuCommunicator::checkUsable() const {
  if (shut_down_) throw CommError("resident: the process group was shut down");
  const std::string err = deviceError();
  if (!err.empty()) throw CommError(err);
}

uint32_t GpuCommunicator::roundsFor(size_t bytes) const {
  const uint64_t r = (bytes + region_.chunk - 1) / region_.chunk;
  if (r > 0xffffffffull) throw InvalidArgument("resident: message too large");
  return r == 0 ? 1u : static_cast<uint32_t>(r);
}

namespace {
// Parts of a first round (at most a chunk: fits 32 bits).
uint32_t partsOf(uint64_t first_round_bytes) {
  return gpu::partsOf(static_cast<uint32_t>(first_round_bytes));
}
uint32_t partsFor(uint64_t first_round_bytes, uint32_t blocks) {
  return (partsOf(first_round_bytes) + blocks - 1) / blocks;
}
}  // namespace

// One block per 2 KiB part of the first (largest) round, within the residency budget.
uint32_t GpuCommunicator::blocksFor(uint64_t first_round_bytes) const {
  const uint32_t parts = partsOf(first_round_bytes);
  return parts < max_blocks_ ? parts : max_blocks_;
}

// Checked triggers pay off for small ops (the proxy starts on the lines while they land); from
// RESIDENT_GPU_TRIGGER_FENCE_FROM (64 KiB, a full chunk) bytes per peer and round those ops
// fence on the device. Since the proxy checks and copies a line in one pass (fused check),
// unfenced rounds of 32 KiB per peer read 5-22% faster than fenced ones in both repetitions
// of one call (session 27, H200, benchmarks/RESULTS.md); at 64 KiB per peer the two were
// within 4%, and before the fused check unfenced was 31% slower there (session 26).
uint32_t GpuCommunicator::fenceTriggers(uint64_t first_round_bytes) const {
  return region_.trigger_fence != 0 || first_round_bytes >= fence_from_ ? 1u : 0u;
}

gpu::CollectiveArgs& GpuCommunicator::begin(OpId op) {
  checkUsable();
  gpu::CollectiveArgs& a = args_;
  a.reg = region_;
  a.reg.timeout_ns = timeout_ns_.load(std::memory_order_relaxed);
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

void GpuCommunicator::launchCollective(void* stream) {
  gpu::CollectiveArgs& a = args_;
  uint32_t rounds_max = 0;
  uint64_t first_round_max = 0;
  bool any_simple = false;  // a partner exchanges this op with the simple protocol
  for (int p = 0; p < nranks_; ++p) {
    const gpu::PeerPlan& pp = a.peers[p];
    if (pp.rounds == 0) continue;
    rounds_max = pp.rounds > rounds_max ? pp.rounds : rounds_max;
    const uint64_t b = pp.send_bytes > pp.recv_bytes ? pp.send_bytes : pp.recv_bytes;
    const uint64_t first = b < region_.chunk ? b : region_.chunk;
    first_round_max = first > first_round_max ? first : first_round_max;
    any_simple |= p != rank_ && gpu::simplePair(a.reg, p, static_cast<uint32_t>(first));
  }
  if (rounds_max == 0) return;  // nothing to exchange with anyone (e.g. a group of one)
  // The same bytes to every partner? Then their first word can be loaded at kernel start.
  a.common_send = nullptr;
  a.common_send_bytes = 0;
  if (prefetch_) {
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
  }
  a.rounds_max = rounds_max;
  a.reg.trigger_fence = fenceTriggers(first_round_max);
  a.reg.simple = any_simple ? 1u : 0u;  // the kernel built with the simple protocol, if needed
  // Decode size (one round with every partner): the resident kernel's blocks run it. Not,
  // by default, when captured: a replay finds no instance after an idle exit, and its
  // relaunch from another thread blocks inside the driver while the caller sits in a pageable
  // copy on the legacy default stream behind the replay (H200, scripts/launch_block_probe.cu);
  // a kernel node of the graph needs no relaunch (and was 1.1-4.5x faster in graphs,
  // benchmarks/RESULTS.md).
  if (persistent_ && rounds_max == 1) {
    const bool captured = capturing(stream);
    if (persistent_graphs_ || !captured) {
      a.parts_per_block = partsFor(first_round_max, persistent_->blocks());
      persistent_->enqueue(a, stream, captured);
      return;
    }
  }
  // One round with every partner, a block per 2 KiB part within the block budget: the
  // one-round kernel, a thread per line (fewer threads for an op of one part).
  const uint32_t parts = partsOf(first_round_max);
  if (one_round_ && rounds_max == 1 && parts <= max_blocks_ && !any_simple) {
    // Lines of part 0 (a whole part when there are several), at least the one credit line.
    const uint32_t lines = gpu::payloadLines(static_cast<uint32_t>(first_round_max), 0);
    const unsigned threads = ((lines ? lines : 1u) + 31) / 32 * 32;
    a.parts_per_block = 1;
    checkCuda(gpu::launchOneRound(a, parts, threads, static_cast<cudaStream_t>(stream), pdl_),
              "launching the one-round collective kernel");
    return;
  }
  const uint32_t blocks = blocksFor(first_round_max);
  a.parts_per_block = partsFor(first_round_max, blocks);
  checkCuda(gpu::launchCollective(a, blocks, static_cast<cudaStream_t>(stream), pdl_),
            "launching the collective kernel");
}

void GpuCommunicator::allReduce(const void* in, void* out, size_t count, DType dtype, RedOp op,
                                void* stream) {
  comm_.checkReduction(dtype, op, "all_reduce");
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
  comm_.checkReduction(dtype, op, "reduce_scatter");
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
  comm_.checkReduction(dtype, op, "reduce");
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
  a.reg = region_;
  a.reg.timeout_ns = timeout_ns_.load(std::memory_order_relaxed);
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
  checkCuda(is_send ? gpu::launchSend(a, blocks, s, pdl_) : gpu::launchRecv(a, blocks, s, pdl_),
            is_send ? "launching the send kernel" : "launching the recv kernel");
}

void GpuCommunicator::send(const void* buf, size_t bytes, int peer, void* stream) {
  launchP2P(true, buf, nullptr, bytes, peer, stream);
}

void GpuCommunicator::recv(void* buf, size_t bytes, int peer, void* stream) {
  launchP2P(false, nullptr, buf, bytes, peer, stream);
}

}  // namespace resident
