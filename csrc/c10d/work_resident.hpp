// The Work a resident op returns: wraps one or more pooled core ops, keeps the tensors alive
// while they are in flight, and completes a future when asked for one. wait() drives
// progress on the calling thread, so a blocking op costs no thread hand-off.
// Under a profiler it carries the op's event (op_record.hpp), ended on the caller's side when
// the op is seen to have finished (wait, is_completed, the group's next op, abort), never on
// the proxy thread, where the profiling session cannot be checked.
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <memory>
#include <vector>

#include "c10d/op_record.hpp"
#include "core/communicator.hpp"

namespace resident {

// The core ops one call starts (a coalesced call: several).
using OpList = c10::SmallVectorImpl<OpHandle>;

class WorkResident : public c10d::Work {
 public:
  WorkResident(std::shared_ptr<Communicator> comm, int rank, c10d::OpType type,
               const char* profiling_title, std::vector<at::Tensor> outputs,
               std::vector<at::Tensor> keep_alive);
  ~WorkResident() override;

  // Where the call starts its ops.
  OpList& ops() { return ops_; }
  // The tensors an op's profiler event reports as its inputs: what it holds besides its
  // outputs, or its outputs when it works in place (a scatter's non-root ranks have none).
  static c10::ArrayRef<at::Tensor> recordedInputs(c10d::OpType type,
                                                  c10::ArrayRef<at::Tensor> outputs,
                                                  c10::ArrayRef<at::Tensor> keep_alive) {
    return type == c10d::OpType::SCATTER || !keep_alive.empty() ? keep_alive : outputs;
  }
  // Once the work has completed (isCompleted() returned true): gives its ops back to the pool,
  // keeping their outcome, so that finished works a caller still holds do not fill the pool.
  void releaseOps();
  // Ends the op's profiler event now (the group aborts, its ops failed).
  void endRecord() { record_.end(); }

  // Waits for `ops` on this thread; a DistBackendError when one is still in flight past
  // `timeout_ns` (0: the group's timeout). Failed ops are left to the caller's check.
  static void waitOps(Engine& engine, c10::ArrayRef<OpHandle> ops, uint64_t timeout_ns);

  bool isCompleted() override;
  // isCompleted() without a progress pass: a cheap check for many works at once.
  bool completedNow();
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override { return outputs_; }
  // A recv's sender (for a recv from any source: the peer whose message it took), once done.
  int sourceRank() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  static void onOpDone(void* self);
  // Inspects finished ops; records the first error. Returns true when all finished.
  bool collect();
  [[noreturn]] void rethrow() const;

  std::shared_ptr<Communicator> comm_;
  c10::SmallVector<OpHandle, 4> ops_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keep_alive_;
  std::atomic<bool> finished_{false};
  std::atomic<bool> released_{false};  // the ops went back to the pool (releaseOps)
  bool failed_ = false;
  std::string error_;
  int source_ = -1;  // a recv's sender, taken when it finished
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<int> future_pending_{0};
  OpRecord record_;
};

}  // namespace resident
