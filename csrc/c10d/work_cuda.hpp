// CUDA tensors in the adapter: the Work of an op that runs as a kernel on a stream, and the
// launch helper that picks the stream like ProcessGroupNCCL does (async_op=False: the
// caller's current stream; async_op=True: the group's own stream, which waits for the
// current one; under graph capture always the current stream, with no events and no host
// synchronisation). Only this file's .cpp includes the torch CUDA headers.
#pragma once

#include <c10/util/FunctionRef.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/gpu_communicator.hpp"

namespace resident {

class CudaStreams;  // the group's side stream, event pool and last-used stream

// True when this build has the CUDA path (false: CUDA tensors get a clear error).
bool cudaPathBuilt();

class WorkCuda : public c10d::Work {
 public:
  WorkCuda(std::shared_ptr<GpuCommunicator> gpu, std::shared_ptr<CudaStreams> streams, int rank,
           c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
           c10::Device device, void* end_event, bool captured = false,
           std::vector<at::Tensor> keep_alive = {});
  ~WorkCuda() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override { return outputs_; }
  // Makes the current stream wait for the op (no host blocking); raises a device-side error.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void streamWait();
  std::shared_ptr<GpuCommunicator> gpu_;
  std::shared_ptr<CudaStreams> streams_;
  std::vector<at::Tensor> outputs_;
  c10::Device device_;
  void* end_event_;  // cudaEvent_t of an async op; null when stream-ordered on the caller's
  // Recorded during a graph capture: joined only while that capture is under way, and the
  // inputs are held until then (no recordStream inside a capture).
  const bool captured_;
  std::vector<at::Tensor> keep_alive_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// Where an op runs. Collectives: the caller's stream, or the group's side stream when async.
// Point-to-point: a stream of its own per (peer, direction), forked from the caller's stream,
// so that an irecv posted before an isend (a ring) cannot block the isend behind it, as with
// ProcessGroupNCCL's per-pair p2p streams; the Work joins it back on wait().
struct CudaRoute {
  enum Kind { kCollective, kSend, kRecv } kind = kCollective;
  int peer = -1;
};

// Runs `launch(gpu, stream)` for an op on CUDA tensors and returns its Work. Creates the
// group's CUDA path on first use (on the tensors' device).
c10::intrusive_ptr<c10d::Work> runCudaOp(Communicator& comm, std::shared_ptr<GpuCommunicator>& gpu,
                                         std::shared_ptr<CudaStreams>& streams, uint64_t timeout_ms,
                                         int rank, c10d::OpType type, const char* title,
                                         const std::vector<at::Tensor>& outputs,
                                         const std::vector<at::Tensor>& inputs, bool async_op,
                                         CudaRoute route,
                                         c10::function_ref<void(GpuCommunicator&, void*)> launch);

// The resident kernel's counters (RESIDENT_GPU_PERSISTENT) as name -> value; "installed" is 0
// before the group's first CUDA op.
std::map<std::string, int64_t> persistentStatusOf(const std::shared_ptr<GpuCommunicator>& gpu);

// Shuts the CUDA path down (waits for its kernels, releases registrations).
void shutdownCuda(std::shared_ptr<GpuCommunicator>& gpu, std::shared_ptr<CudaStreams>& streams);

}  // namespace resident
