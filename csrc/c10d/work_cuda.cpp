#include "c10d/work_cuda.hpp"

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <map>

#include "core/error.hpp"

namespace resident {

bool cudaPathBuilt() {
  return true;
}

namespace {

// Streams for point-to-point ops outlive their group: the caching allocator may still record
// events on them when tensors used by an op are freed after the group is gone. A group hands
// its streams back here at destruction, and later groups reuse them.
class P2PStreamPool {
 public:
  static P2PStreamPool& instance() {
    static P2PStreamPool* pool = new P2PStreamPool();  // never destroyed (process lifetime)
    return *pool;
  }
  cudaStream_t take(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& list = free_[device];
    if (!list.empty()) {
      cudaStream_t s = list.back();
      list.pop_back();
      return s;
    }
    int lo = 0, hi = 0;
    C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    cudaStream_t s = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, hi));
    return s;
  }
  void give(int device, cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[device].push_back(s);
  }

 private:
  std::mutex mu_;
  std::map<int, std::vector<cudaStream_t>> free_;
};

}  // namespace

// Per group: the side stream for async ops, a pool of events (no event creation per op) and
// the stream of the previous eager op (ops of one group are serialised across streams).
class CudaStreams {
 public:
  CudaStreams(int device, int nranks)
      : device_(device),
        side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)),
        p2p_(static_cast<size_t>(2 * nranks), nullptr) {}
  ~CudaStreams() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
    for (cudaStream_t s : p2p_)
      if (s != nullptr) P2PStreamPool::instance().give(device_, s);
  }
  cudaEvent_t get() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void put(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(e);
  }
  // The stream of one point-to-point direction with one peer, created on first use (not from
  // torch's pool, whose streams are shared round-robin and could put a send behind a recv).
  c10::cuda::CUDAStream p2p(int peer, bool send) {
    cudaStream_t& s = p2p_[static_cast<size_t>(2 * peer + (send ? 1 : 0))];
    if (s == nullptr) s = P2PStreamPool::instance().take(device_);
    return c10::cuda::getStreamFromExternal(s, device_);
  }
  const int device_;
  c10::cuda::CUDAStream side_;
  cudaStream_t last_ = nullptr;  // stream of the previous collective (eager)

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
  std::vector<cudaStream_t> p2p_;
};

WorkCuda::WorkCuda(std::shared_ptr<GpuCommunicator> gpu, std::shared_ptr<CudaStreams> streams,
                   int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                   c10::Device device, void* end_event, bool captured,
                   std::vector<at::Tensor> keep_alive)
    : c10d::Work(rank, type, title),
      gpu_(std::move(gpu)),
      streams_(std::move(streams)),
      outputs_(std::move(outputs)),
      device_(device),
      end_event_(end_event),
      captured_(captured),
      keep_alive_(std::move(keep_alive)) {}

WorkCuda::~WorkCuda() {
  if (end_event_ == nullptr) return;
  if (captured_)
    cudaEventDestroy(static_cast<cudaEvent_t>(end_event_));  // not reused after a capture
  else
    streams_->put(static_cast<cudaEvent_t>(end_event_));
}

bool WorkCuda::isCompleted() {
  // Stream-ordered on the caller's stream, or part of a graph: complete from the host's view.
  if (end_event_ == nullptr || captured_) return true;
  return cudaEventQuery(static_cast<cudaEvent_t>(end_event_)) == cudaSuccess;
}

bool WorkCuda::isSuccess() const {
  return gpu_->deviceError().empty();
}

std::exception_ptr WorkCuda::exception() const {
  const std::string err = gpu_->deviceError();
  if (err.empty()) return nullptr;
  return std::make_exception_ptr(
      c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, err));
}

void WorkCuda::streamWait() {
  if (end_event_ == nullptr) return;
  c10::cuda::CUDAGuard guard(device_);
  cudaStream_t current = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
  if (captured_) {
    // A captured op's side stream joins its capture; once that capture ended, the graph
    // already orders it (and waiting on a captured event outside the capture is an error).
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(current, &status));
    if (status != cudaStreamCaptureStatusActive) return;
  }
  C10_CUDA_CHECK(cudaStreamWaitEvent(current, static_cast<cudaEvent_t>(end_event_), 0));
  keep_alive_.clear();  // the caller's stream is now ordered after the op
}

bool WorkCuda::wait(std::chrono::milliseconds /*timeout*/) {
  streamWait();
  const std::string err = gpu_->deviceError();
  if (!err.empty()) C10_THROW_ERROR(DistBackendError, err);
  return true;
}

void WorkCuda::synchronize() {
  streamWait();
}

c10::intrusive_ptr<c10::ivalue::Future> WorkCuda::getFuture() {
  if (!future_) {
    // A CUDA-aware future: completing it records an event on the current stream, which
    // (after streamWait) is ordered after the op; consumers' streams wait on that event.
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device_});
    streamWait();
    future_->markCompleted(c10::IValue(outputs_));
  }
  return future_;
}

c10::intrusive_ptr<c10d::Work> runCudaOp(Communicator& comm, std::shared_ptr<GpuCommunicator>& gpu,
                                         std::shared_ptr<CudaStreams>& streams, uint64_t timeout_ms,
                                         int rank, c10d::OpType type, const char* title,
                                         const std::vector<at::Tensor>& outputs,
                                         const std::vector<at::Tensor>& inputs, bool async_op,
                                         CudaRoute route,
                                         c10::function_ref<void(GpuCommunicator&, void*)> launch) {
  if (route.kind != CudaRoute::kCollective &&
      (route.peer < 0 || route.peer >= comm.size() || route.peer == comm.rank())) {
    throw InvalidArgument(
        std::string("resident: ") + (route.kind == CudaRoute::kSend ? "send to" : "recv from") +
        " rank " + std::to_string(route.peer) + " is invalid in a group of " +
        std::to_string(comm.size()) + " (this is rank " + std::to_string(comm.rank()) + ")");
  }
  const at::Tensor& first = !inputs.empty() ? inputs[0] : outputs.at(0);
  const c10::Device device = first.device();
  c10::cuda::CUDAGuard guard(device);
  if (!gpu) {
    gpu = std::make_shared<GpuCommunicator>(comm, device.index(), timeout_ms);
    streams = std::make_shared<CudaStreams>(device.index(), comm.size());
  } else if (gpu->device() != device.index()) {
    throw InvalidArgument(
        "resident: this group's CUDA path is on cuda:" + std::to_string(gpu->device()) +
        " but the tensors are on " + device.str() + "; use one device per group");
  }
  cudaStream_t current = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(current, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  // A send/recv on a stream of its own (per peer and direction) unless configured to run on
  // the caller's stream like a collective.
  const bool p2p = route.kind != CudaRoute::kCollective && comm.config().gpu_p2p_stream == "own";
  if (capturing && !p2p) {
    // In a graph: the kernel becomes a node on the capturing stream; nothing else.
    launch(*gpu, current);
    return c10::make_intrusive<WorkCuda>(gpu, streams, rank, type, title, outputs, device, nullptr);
  }
  c10::optional<c10::cuda::CUDAStream> own;
  if (p2p) own = streams->p2p(route.peer, route.kind == CudaRoute::kSend);
  cudaStream_t stream = p2p ? own->stream() : (async_op ? streams->side_.stream() : current);
  // Order after what came before: the op's stream waits for the caller's stream (inputs
  // ready; under capture this forks the side stream into the graph), and a collective also
  // for the previous collective when that went to another stream (one at a time per group).
  auto follow = [&](cudaStream_t waiter, cudaStream_t on) {
    cudaEvent_t e = streams->get();
    C10_CUDA_CHECK(cudaEventRecord(e, on));
    C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, e, 0));
    streams->put(e);
  };
  if (!p2p && streams->last_ != nullptr && streams->last_ != stream && streams->last_ != current)
    follow(stream, streams->last_);
  if (stream != current) follow(stream, current);
  launch(*gpu, stream);
  if (!p2p) streams->last_ = stream;
  cudaEvent_t end = nullptr;
  if (stream != current) {
    end = streams->get();
    C10_CUDA_CHECK(cudaEventRecord(end, stream));
    if (!capturing) {
      // The caching allocator must not hand these tensors out again before the op's stream
      // has passed them.
      const c10::cuda::CUDAStream used =
          p2p ? *own : c10::cuda::getStreamFromExternal(stream, device.index());
      for (const auto* list : {&inputs, &outputs})
        for (const at::Tensor& t : *list)
          c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), used);
    }
  }
  return c10::make_intrusive<WorkCuda>(gpu, streams, rank, type, title, outputs, device, end,
                                       capturing, capturing ? inputs : std::vector<at::Tensor>{});
}

std::map<std::string, int64_t> persistentStatusOf(const std::shared_ptr<GpuCommunicator>& gpu) {
  std::map<std::string, int64_t> out{{"installed", gpu ? 1 : 0}};
  const PersistentChannel* ch = gpu ? gpu->persistent() : nullptr;
  if (ch == nullptr) return out;
  const PersistentStatus s = ch->status();
  out["running"] = s.running ? 1 : 0;
  out["queued"] = s.queued ? 1 : 0;
  out["launches"] = s.launches;
  out["exits"] = s.exits;
  out["served"] = s.served;
  out["graph_slots_used"] = s.graph_slots_used;
  out["slots"] = s.slots;
  out["blocks"] = s.blocks;
  return out;
}

void shutdownCuda(std::shared_ptr<GpuCommunicator>& gpu, std::shared_ptr<CudaStreams>& streams) {
  if (gpu) gpu->shutdown();
  streams.reset();
}

}  // namespace resident
