// CUDA tensors in the adapter: the Work of an op that runs as a kernel on a stream, and the
// group's CUDA path (CudaPath), whose launches pick the stream like ProcessGroupNCCL does
// (async_op=False: the caller's current stream; async_op=True: the group's own stream, which waits
// for the current one; under graph capture always the current stream, with no host synchronisation;
// send/recv: see CudaPath::pointToPoint). Only this file's .cpp includes the torch CUDA headers.
// Profiler events also follow ProcessGroupNCCL: an op's event spans its kernel's launch on
// the host, so the profiler ties the kernel (and a GPU annotation over it) to the event.
#pragma once

#include <c10/util/FunctionRef.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "c10d/op_record.hpp"
#include "cuda/gpu_communicator.hpp"

namespace resident {

class CudaStreams;  // the group's side stream, event pool and last-used stream

// True when this build has the CUDA path (false: CUDA tensors get a clear error).
bool cudaPathBuilt();

class WorkCuda : public c10d::Work {
 public:
  // `record`: the op's profiler event when it is still open (a send/recv not launched yet).
  WorkCuda(std::shared_ptr<GpuCommunicator> gpu, std::shared_ptr<CudaStreams> streams, int rank,
           c10d::OpType type, OpRecord record, std::vector<at::Tensor> outputs, c10::Device device,
           void* end_event, bool captured = false, std::vector<at::Tensor> keep_alive = {});
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
  // A send/recv's profiler event: ended on the caller's side once its kernel is launched.
  OpRecord record_;

  // A send or recv not launched yet (see CudaPath::pointToPoint); null once launched.
  struct P2PLaunch;
  std::unique_ptr<P2PLaunch> p2p_;
  std::string launch_error_;  // why launching it failed (then wait() raises it)
  // Launches `p` on `stream` when `on_caller` (a blocking send/recv: the stream it was called
  // on; null is the default stream) or else on the stream of its peer and direction, from the
  // point it was called at, and hands its ready event back; a failure is also kept for wait().
  void launchP2P(const P2PLaunch& p, bool on_caller, void* stream = nullptr);
  // The same for the held op p2p_ (lazy), under the process's pending-op lock; it returns the
  // spent launch, which holds the tensor, for release after unlocking (a tensor's last
  // reference can run Python code that destroys another Work, which takes that lock).
  std::unique_ptr<P2PLaunch> launchHeldP2P(bool on_caller, void* stream = nullptr);
  void launchP2PNow(const P2PLaunch& p, bool on_caller, void* stream);
  static std::unique_ptr<P2PLaunch> launchPendingLocked();
  // Set for a lazily launched send/recv: its wait, is_completed and destruction take the
  // pending-op lock, since another thread's resident call may be launching it.
  bool lazy_p2p_ = false;
  // A launch that failed: released with the Work, on its owner's thread.
  std::unique_ptr<P2PLaunch> parked_;
  friend void flushPendingP2P();
  friend class CudaPath;
};

// A group's CUDA path: its GpuCommunicator and streams, created on the first op on CUDA
// tensors (on their device), and every CUDA op of the group launched as a Work.
class CudaPath {
 public:
  CudaPath(Communicator& comm, int rank, uint64_t timeout_ms)
      : comm_(comm), rank_(rank), timeout_ms_(timeout_ms) {}
  CudaPath(const CudaPath&) = delete;
  CudaPath& operator=(const CudaPath&) = delete;

  // Runs `launch(gpu, stream)` for a collective and returns its Work: on the caller's stream,
  // or the group's side stream when async.
  c10::intrusive_ptr<c10d::Work> collective(
      c10d::OpType type, const char* title, const std::vector<at::Tensor>& outputs,
      const std::vector<at::Tensor>& inputs, bool async_op,
      c10::function_ref<void(GpuCommunicator&, void*)> launch);

  // A send (`send`) or recv of `tensor` with `peer`. Outside a graph capture its kernel is
  // launched at once on a stream of its own per peer and direction, ordered after the point it
  // was called at and joined back on wait(), so that isend/irecv in any order cannot block each
  // other (as ProcessGroupNCCL's p2p streams). It is never held: a held op waits for its
  // process's host, and a host thread can block inside CUDA while the peer waits for it (the
  // first launch of any kernel under lazy module loading waits for the device's work to drain,
  // holding the context's lock that a helper thread's launch would need; docs/op_mix.md).
  // During a capture (RESIDENT_GPU_P2P_STREAM=auto) it is launched lazily: if the next thing
  // this process does with resident is this op's own wait() on the capturing stream (c10d's
  // blocking send/recv), the kernel joins that stream, where it gets programmatic dependent
  // launch; anything else first (another resident call, another Work's wait, is_completed(),
  // dropping the Work) puts it on its own stream, joined to the capture. No kernel runs during
  // a capture, so holding one blocks nobody. RESIDENT_GPU_P2P_STREAM=own launches every
  // send/recv the first way at once.
  c10::intrusive_ptr<c10d::Work> pointToPoint(c10d::OpType type, const char* title,
                                              const at::Tensor& tensor, bool send, int peer);

  // The device-side timeout of later and running kernels.
  void setTimeoutMs(uint64_t ms);
  // Waits for the path's kernels and releases its registrations and streams. Idempotent.
  void shutdown();

 private:
  // The path on the tensors' device, created on first use; the caller sets the device.
  c10::Device deviceFor(const at::Tensor& first);

  Communicator& comm_;
  const int rank_;
  uint64_t timeout_ms_;
  std::shared_ptr<GpuCommunicator> gpu_;
  std::shared_ptr<CudaStreams> streams_;
};

// Launches the send/recv still waiting to be launched, if any (every resident call does this
// first, in any group: at most one op is pending in the process).
void flushPendingP2P();

}  // namespace resident
