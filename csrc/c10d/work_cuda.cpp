#include "c10d/work_cuda.hpp"

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "core/error.hpp"

namespace resident {

bool cudaPathBuilt() {
  return true;
}

// Per group: the side stream for async ops, a pool of events (no event creation per op) and
// the stream of the previous eager op (ops of one group are serialised across streams).
class CudaStreams {
 public:
  explicit CudaStreams(int device)
      : side_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device)) {}
  ~CudaStreams() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
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
  c10::cuda::CUDAStream side_;
  cudaStream_t last_ = nullptr;

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

WorkCuda::WorkCuda(std::shared_ptr<GpuCommunicator> gpu, std::shared_ptr<CudaStreams> streams,
                   int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
                   c10::Device device, void* end_event)
    : c10d::Work(rank, type, title),
      gpu_(std::move(gpu)),
      streams_(std::move(streams)),
      outputs_(std::move(outputs)),
      device_(device),
      end_event_(end_event) {}

WorkCuda::~WorkCuda() {
  if (end_event_ != nullptr) streams_->put(static_cast<cudaEvent_t>(end_event_));
}

bool WorkCuda::isCompleted() {
  if (end_event_ == nullptr) return true;  // stream-ordered on the caller's stream
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
  C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_.index()).stream(),
                                     static_cast<cudaEvent_t>(end_event_), 0));
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
                                         c10::function_ref<void(GpuCommunicator&, void*)> launch) {
  const at::Tensor& first = !inputs.empty() ? inputs[0] : outputs.at(0);
  const c10::Device device = first.device();
  c10::cuda::CUDAGuard guard(device);
  if (!gpu) {
    gpu = std::make_shared<GpuCommunicator>(comm, device.index(), timeout_ms);
    streams = std::make_shared<CudaStreams>(device.index());
  } else if (gpu->device() != device.index()) {
    throw InvalidArgument(
        "resident: this group's CUDA path is on cuda:" + std::to_string(gpu->device()) +
        " but the tensors are on " + device.str() + "; use one device per group");
  }
  cudaStream_t current = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(current, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    // In a graph: the kernel becomes a node on the capturing stream; nothing else.
    launch(*gpu, current);
    return c10::make_intrusive<WorkCuda>(gpu, streams, rank, type, title, outputs, device, nullptr);
  }
  cudaStream_t stream = async_op ? streams->side_.stream() : current;
  // Ops of one group run one at a time on the device: order after the previous op when it
  // went to another stream (and the side stream after the caller's work).
  auto follow = [&](cudaStream_t waiter, cudaStream_t on) {
    cudaEvent_t e = streams->get();
    C10_CUDA_CHECK(cudaEventRecord(e, on));
    C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, e, 0));
    streams->put(e);
  };
  if (streams->last_ != nullptr && streams->last_ != stream && streams->last_ != current)
    follow(stream, streams->last_);
  if (stream != current) follow(stream, current);
  launch(*gpu, stream);
  streams->last_ = stream;
  cudaEvent_t end = nullptr;
  if (stream != current) {
    end = streams->get();
    C10_CUDA_CHECK(cudaEventRecord(end, stream));
    // The caching allocator must not hand these tensors out again before the side stream
    // has passed them.
    for (const auto* list : {&inputs, &outputs})
      for (const at::Tensor& t : *list)
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), streams->side_);
  }
  return c10::make_intrusive<WorkCuda>(gpu, streams, rank, type, title, outputs, device, end);
}

void shutdownCuda(std::shared_ptr<GpuCommunicator>& gpu, std::shared_ptr<CudaStreams>& streams) {
  if (gpu) gpu->shutdown();
  streams.reset();
}

}  // namespace resident
