#include "c10d/work_cuda.hpp"

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <atomic>
#include <map>

#include "c10d/synchronous_call.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "cuda/cuda_guards.hpp"

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
        p2p_(static_cast<size_t>(2 * nranks), nullptr),
        tails_(static_cast<size_t>(2 * nranks)) {}
  ~CudaStreams() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
    if (last_end_ != nullptr) cudaEventDestroy(last_end_);
    for (const P2PTail& t : tails_) {
      if (t.own_end != nullptr) cudaEventDestroy(t.own_end);
      if (t.caller_end != nullptr) cudaEventDestroy(t.caller_end);
    }
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
  // An event done with: back to the pool, or destroyed if it was recorded inside a capture
  // (not reused after one).
  void giveBack(cudaEvent_t e, bool captured) {
    if (captured)
      cudaEventDestroy(e);
    else
      put(e);
  }
  // The stream of one point-to-point direction with one peer, created on first use (not from
  // torch's pool, whose streams are shared round-robin and could put a send behind a recv).
  c10::cuda::CUDAStream p2p(int peer, bool send) {
    cudaStream_t& s = p2p_[2 * static_cast<size_t>(peer) + (send ? 1 : 0)];
    if (s == nullptr) s = P2PStreamPool::instance().take(device_);
    return c10::cuda::getStreamFromExternal(s, device_);
  }
  // Ordering between the two places a send/recv of one peer and direction can run (its own
  // stream, a caller's stream): their kernels share that direction's round counter, so each
  // must start after the previous one of the direction.
  struct P2PTail {
    cudaEvent_t own_end = nullptr;       // recorded after the last launch on the own stream
    unsigned long long own_capture = 0;  // capture id of that record (0: eager)
    bool own_unjoined = false;           // no caller-stream launch has waited on it yet
    // Recorded after the last launch on a caller's stream (waited on through the event: the
    // caller's stream may be gone by then; its handle is only compared).
    cudaEvent_t caller_end = nullptr;
    unsigned long long caller_capture = 0;
    bool caller_unjoined = false;  // not yet waited on by a launch on another stream
    cudaStream_t caller_stream = nullptr;
  };
  P2PTail& tail(int peer, bool send) {
    auto& t = tails_[2 * static_cast<size_t>(peer) + (send ? 1 : 0)];
    if (t.own_end == nullptr) {
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&t.own_end, cudaEventDisableTiming));
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&t.caller_end, cudaEventDisableTiming));
    }
    return t;
  }
  // The previous eager collective: its stream (compared only; null is the default stream)
  // and an event recorded after it, which a collective on another stream waits for.
  cudaEvent_t lastEnd() {
    if (last_end_ == nullptr)
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&last_end_, cudaEventDisableTiming));
    return last_end_;
  }
  const int device_;
  c10::cuda::CUDAStream side_;
  bool has_last_ = false;
  cudaStream_t last_ = nullptr;

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
  std::vector<cudaStream_t> p2p_;
  std::vector<P2PTail> tails_;
  cudaEvent_t last_end_ = nullptr;
};

struct WorkCuda::P2PLaunch {
  bool send;
  void* data;
  size_t bytes;
  int peer;
  cudaStream_t caller;             // the current stream when the op was called
  cudaEvent_t ready;               // recorded on `caller` then: the op's inputs are ready
  unsigned long long capture = 0;  // id of the capture under way on `caller` then (0: none)
  at::Tensor tensor;               // for the caching allocator, if it runs elsewhere
  bool lazy;                       // held until its wait (a capture under auto): see pointToPoint
};

namespace {

// The one send/recv of this process not launched yet: one called during a graph capture
// (every resident call launches the previous one first, so there is never more than one).
// Written under pending_mu; read without it first, so that ops with nothing pending (every
// eager op) take no lock.
std::mutex pending_mu;
std::atomic<WorkCuda*> pending_work{nullptr};

void clearPendingLocked() {
  pending_work.store(nullptr, std::memory_order_release);
}

unsigned long long captureIdOf(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(s, &status, &id));
  return status == cudaStreamCaptureStatusActive ? id : 0;
}

}  // namespace

WorkCuda::WorkCuda(std::shared_ptr<GpuCommunicator> gpu, std::shared_ptr<CudaStreams> streams,
                   int rank, c10d::OpType type, OpRecord record, std::vector<at::Tensor> outputs,
                   c10::Device device, void* end_event, bool captured,
                   std::vector<at::Tensor> keep_alive)
    // No title for c10d::Work: its RecordFunction would end only with the Work (record_).
    : c10d::Work(rank, type),
      gpu_(std::move(gpu)),
      streams_(std::move(streams)),
      outputs_(std::move(outputs)),
      device_(device),
      end_event_(end_event),
      captured_(captured),
      keep_alive_(std::move(keep_alive)),
      record_(std::move(record)) {}

WorkCuda::~WorkCuda() {
  std::unique_ptr<P2PLaunch> spent;  // released after the lock (see launchP2P)
  if (lazy_p2p_) {
    std::lock_guard<std::mutex> lock(pending_mu);  // another thread's call may be launching it
    if (p2p_) {
      // Dropped before its wait: it must still run (the peer is matching it).
      try {
        spent = launchHeldP2P(false);
      } catch (const std::exception& e) {
        RLOG_ERROR("resident: launching a send/recv whose Work was dropped failed: %s", e.what());
      }
      clearPendingLocked();
    }
  }
  if (end_event_ != nullptr) streams_->giveBack(static_cast<cudaEvent_t>(end_event_), captured_);
}

void WorkCuda::launchP2P(const P2PLaunch& p, bool on_caller, void* stream) {
  try {
    launchP2PNow(p, on_caller, static_cast<cudaStream_t>(stream));
  } catch (const std::exception& e) {
    // This op will not run; its own wait() says so too (the exception itself goes to whoever
    // launched it, which may be another op's call).
    launch_error_ = std::string("resident: this ") + (p.send ? "send" : "recv") +
                    " could not be launched: " + e.what();
    streams_->giveBack(p.ready, p.capture != 0);
    throw;
  }
  streams_->giveBack(p.ready, p.capture != 0);
}

std::unique_ptr<WorkCuda::P2PLaunch> WorkCuda::launchHeldP2P(bool on_caller, void* stream) {
  std::unique_ptr<P2PLaunch> p = std::move(p2p_);
  try {
    launchP2P(*p, on_caller, stream);
  } catch (...) {
    // Not released here, where the pending-op lock is held (a tensor's last reference can
    // take the GIL): it goes with the Work.
    parked_ = std::move(p);
    throw;
  }
  return p;
}

void WorkCuda::launchP2PNow(const P2PLaunch& p, bool on_caller, void* stream) {
  c10::cuda::CUDAGuard guard(device_);
  auto run = [&](cudaStream_t on) {
    if (p.send)
      gpu_->send(p.data, p.bytes, p.peer, on);
    else
      gpu_->recv(p.data, p.bytes, p.peer, on);
  };
  // Lazy launches (inside a capture): the direction's kernels share its round counter, so each
  // starts after the previous one of the same capture, wherever that ran (a flag is cleared
  // only once a launch has waited for it). Eager ones are all on the direction's own stream,
  // in order.
  CudaStreams::P2PTail* tail = p.lazy ? &streams_->tail(p.peer, p.send) : nullptr;
  RLOG_DEBUG("%s %zu bytes with rank %d: launched on %s%s", p.send ? "send" : "recv", p.bytes,
             p.peer, on_caller ? "the caller's stream" : "its own stream",
             p.capture != 0 ? " (in a capture)" : "");
  if (on_caller) {
    auto s = static_cast<cudaStream_t>(stream);
    if (tail->own_unjoined && tail->own_capture == p.capture) {
      C10_CUDA_CHECK(cudaStreamWaitEvent(s, tail->own_end, 0));
      tail->own_unjoined = false;
    }
    if (tail->caller_unjoined && tail->caller_capture == p.capture && tail->caller_stream != s)
      C10_CUDA_CHECK(cudaStreamWaitEvent(s, tail->caller_end, 0));
    run(s);
    C10_CUDA_CHECK(cudaEventRecord(tail->caller_end, s));
    tail->caller_capture = p.capture;
    tail->caller_stream = s;
    tail->caller_unjoined = true;
    return;
  }
  if (p.capture != 0 && captureIdOf(p.caller) != p.capture) {
    throw InvalidArgument(
        std::string("resident: a ") + (p.send ? "send" : "recv") +
        " called during a CUDA graph capture must be waited on before that capture ends");
  }
  const c10::cuda::CUDAStream own = streams_->p2p(p.peer, p.send);
  if (tail != nullptr && tail->caller_unjoined && tail->caller_capture == p.capture) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(own.stream(), tail->caller_end, 0));
    tail->caller_unjoined = false;
  }
  C10_CUDA_CHECK(cudaStreamWaitEvent(own.stream(), p.ready, 0));
  run(own.stream());
  cudaEvent_t end = streams_->get();
  C10_CUDA_CHECK(cudaEventRecord(end, own.stream()));
  end_event_ = end;
  if (tail != nullptr) {
    C10_CUDA_CHECK(cudaEventRecord(tail->own_end, own.stream()));
    tail->own_capture = p.capture;
    tail->own_unjoined = true;
  }
  // The caching allocator must not hand the tensor out again before this stream passed it.
  if (p.capture == 0)
    c10::cuda::CUDACachingAllocator::recordStream(p.tensor.storage().data_ptr(), own);
}

// Launches the pending op, if any, on its own stream; the caller holds pending_mu and
// releases what it returns only after unlocking (see launchP2P).
std::unique_ptr<WorkCuda::P2PLaunch> WorkCuda::launchPendingLocked() {
  WorkCuda* w = pending_work.load(std::memory_order_acquire);
  if (w == nullptr) return nullptr;
  // Cleared only once launched: meanwhile every other caller sees it pending and waits on the
  // lock (a shutdown or a collective must not overtake it).
  std::unique_ptr<P2PLaunch> spent;
  try {
    spent = w->launchHeldP2P(false);
  } catch (...) {
    clearPendingLocked();
    throw;
  }
  clearPendingLocked();
  return spent;
}

void flushPendingP2P() {
  if (pending_work.load(std::memory_order_acquire) == nullptr) return;
  std::unique_ptr<WorkCuda::P2PLaunch> spent;
  std::lock_guard<std::mutex> lock(pending_mu);
  spent = WorkCuda::launchPendingLocked();
}

bool WorkCuda::isCompleted() {
  // Polled instead of waited on: what is pending (this op or a later one) runs. A lazy op
  // takes the lock even with nothing pending: another thread's call may be launching it.
  if (lazy_p2p_) {
    std::unique_ptr<P2PLaunch> spent;
    std::lock_guard<std::mutex> lock(pending_mu);
    spent = launchPendingLocked();
  } else {
    flushPendingP2P();
  }
  if (!launch_error_.empty()) C10_THROW_ERROR(DistBackendError, launch_error_);
  record_.end();  // launched
  // Stream-ordered on the caller's stream, or part of a graph: complete from the host's view.
  if (end_event_ == nullptr || captured_) return true;
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(end_event_));
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it, or the next launch check reports it
    return false;
  }
  C10_CUDA_CHECK(err);
  return true;
}

bool WorkCuda::isSuccess() const {
  return gpu_->deviceError().empty();
}

std::exception_ptr WorkCuda::exception() const {
  const std::string err = gpu_->deviceErrorFailingGroup();
  if (err.empty()) return nullptr;
  return std::make_exception_ptr(
      c10::DistBackendError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, err));
}

void WorkCuda::streamWait() {
  c10::cuda::CUDAGuard guard(device_);
  cudaStream_t current = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
  // Released after the lock (a tensor's last reference can take the GIL).
  std::unique_ptr<P2PLaunch> spent_other, spent;
  std::vector<at::Tensor> released;
  if (lazy_p2p_ || pending_work.load(std::memory_order_acquire) != nullptr) {
    std::lock_guard<std::mutex> lock(pending_mu);
    // Another op came first: it runs on its own stream.
    if (pending_work != this) spent_other = launchPendingLocked();
    if (p2p_) {
      // Waited on right after the call, on the stream it was called on: a blocking
      // send/recv; it runs in that stream's order (where it was going to be waited on).
      const bool blocking = current == p2p_->caller && captureIdOf(current) == p2p_->capture;
      try {
        spent = launchHeldP2P(blocking, current);
      } catch (...) {
        clearPendingLocked();
        throw;
      }
      clearPendingLocked();  // only now: until launched, other callers wait on the lock
      if (blocking) {
        released.swap(keep_alive_);
        return;
      }
    }
  }
  if (!launch_error_.empty()) C10_THROW_ERROR(DistBackendError, launch_error_);
  if (end_event_ == nullptr) return;
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
  record_.end();  // launched
  const std::string err = gpu_->deviceErrorFailingGroup();
  if (!err.empty()) C10_THROW_ERROR(DistBackendError, err);
  return true;
}

void WorkCuda::synchronize() {
  streamWait();
  record_.end();  // launched
}

c10::intrusive_ptr<c10::ivalue::Future> WorkCuda::getFuture() {
  if (!future_) {
    // A CUDA-aware future: completing it records an event on the current stream, which
    // (after streamWait) is ordered after the op; consumers' streams wait on that event.
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device_});
    streamWait();
    record_.end();  // launched
    future_->markCompleted(c10::IValue(outputs_));
  }
  return future_;
}

c10::Device CudaPath::deviceFor(const at::Tensor& first) {
  const c10::Device device = first.device();
  if (!gpu_) {
    c10::cuda::CUDAGuard guard(device);  // the GPU state is made on the tensors' device
    auto made = std::make_shared<CudaStreams>(device.index(), comm_.size());
    gpu_ = std::make_shared<GpuCommunicator>(comm_, device.index(), timeout_ms_);
    streams_ = std::move(made);
  } else if (gpu_->device() != device.index()) {
    throw InvalidArgument(
        "resident: this group's CUDA path is on cuda:" + std::to_string(gpu_->device()) +
        " but the tensors are on " + device.str() + "; use one device per group");
  }
  return device;
}

c10::intrusive_ptr<c10d::Work> CudaPath::collective(
    c10d::OpType type, const char* title, const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs, bool async_op,
    c10::function_ref<void(GpuCommunicator&, void*)> launch) {
  flushPendingP2P();
  const c10::Device device = deviceFor(!inputs.empty() ? inputs[0] : outputs.at(0));
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t current = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(current, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  // The op's profiler event spans the launch (ProcessGroupNCCL's events do the same).
  OpRecord record = OpRecord::start(title, inputs);
  if (capturing) {
    // In a graph: the kernel becomes a node on the capturing stream; nothing else.
    launch(*gpu_, current);
    record.end();
    if (synchronousCall(async_op)) return {};
    return c10::make_intrusive<WorkCuda>(gpu_, streams_, rank_, type, OpRecord(), outputs, device,
                                         nullptr);
  }
  CudaStreams& streams = *streams_;
  cudaStream_t stream = async_op ? streams.side_.stream() : current;
  // Order after what came before: the op's stream waits for the caller's stream (inputs
  // ready) and for the previous collective when that went to another stream (one at a time
  // per group).
  auto follow = [&](cudaStream_t waiter, cudaStream_t on) {
    cudaEvent_t e = streams.get();
    C10_CUDA_CHECK(cudaEventRecord(e, on));
    C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, e, 0));
    streams.put(e);
  };
  if (streams.has_last_ && streams.last_ != stream && streams.last_ != current)
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, streams.lastEnd(), 0));
  if (stream != current) follow(stream, current);
  launch(*gpu_, stream);
  C10_CUDA_CHECK(cudaEventRecord(streams.lastEnd(), stream));
  streams.last_ = stream;
  streams.has_last_ = true;
  cudaEvent_t end = nullptr;
  if (stream != current) {
    end = streams.get();
    C10_CUDA_CHECK(cudaEventRecord(end, stream));
    // The caching allocator must not hand these tensors out again before the op's stream
    // has passed them.
    const c10::cuda::CUDAStream used = c10::cuda::getStreamFromExternal(stream, device.index());
    for (const auto* list : {&inputs, &outputs})
      for (const at::Tensor& t : *list)
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), used);
  }
  record.end();
  if (synchronousCall(async_op)) return {};  // on the caller's stream: nothing to wait for
  return c10::make_intrusive<WorkCuda>(gpu_, streams_, rank_, type, OpRecord(), outputs, device,
                                       end);
}

c10::intrusive_ptr<c10d::Work> CudaPath::pointToPoint(c10d::OpType type, const char* title,
                                                      const at::Tensor& tensor, bool send,
                                                      int peer) {
  if (peer < 0 || peer >= comm_.size() || peer == comm_.rank()) {
    throw InvalidArgument(std::string("resident: ") + (send ? "send to" : "recv from") + " rank " +
                          std::to_string(peer) + " is invalid in a group of " +
                          std::to_string(comm_.size()) + " (this is rank " +
                          std::to_string(comm_.rank()) + ")");
  }
  flushPendingP2P();
  const c10::Device device = deviceFor(tensor);
  c10::cuda::CUDAGuard guard(device);
  cudaStream_t current = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const unsigned long long capture = captureIdOf(current);
  WorkCuda::P2PLaunch p{send,
                        tensor.data_ptr(),
                        tensor.nbytes(),
                        peer,
                        current,
                        streams_->get(),
                        capture,
                        tensor,
                        capture != 0 && comm_.config().gpu_p2p_stream == P2PStream::kAuto};
  C10_CUDA_CHECK(cudaEventRecord(p.ready, current));
  std::vector<at::Tensor> outputs;
  if (!send) outputs.push_back(tensor);
  // Its profiler event ends once the kernel is launched on this side (here, or in its wait).
  auto work = c10::make_intrusive<WorkCuda>(
      gpu_, streams_, rank_, type, OpRecord::start(title, {tensor}), std::move(outputs), device,
      nullptr, capture != 0,
      capture != 0 ? std::vector<at::Tensor>{tensor} : std::vector<at::Tensor>{});
  if (!p.lazy) {
    work->launchP2P(p, false);  // at once, from the stack: no lock, no allocation
    work->record_.end();
    return work;
  }
  work->p2p_ = std::make_unique<WorkCuda::P2PLaunch>(std::move(p));
  {
    std::unique_ptr<WorkCuda::P2PLaunch> spent;  // another thread's pending op, launched first
    std::lock_guard<std::mutex> lock(pending_mu);
    spent = WorkCuda::launchPendingLocked();  // if it throws, this op is dropped unlaunched
    work->lazy_p2p_ = true;
    pending_work.store(work.get(), std::memory_order_release);
  }
  return work;
}

void CudaPath::setTimeoutMs(uint64_t ms) {
  timeout_ms_ = ms;
  if (gpu_) gpu_->setTimeoutMs(ms);
}

void CudaPath::shutdown() {
  try {
    flushPendingP2P();  // called before the shutdown: it runs (and is aborted with the rest)
  } catch (const std::exception& e) {
    RLOG_WARN("resident: launching a pending send/recv at shutdown failed: %s", e.what());
  }
  if (gpu_) gpu_->shutdown();
  streams_.reset();
}

}  // namespace resident
