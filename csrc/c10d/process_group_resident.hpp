// ProcessGroupResident: the c10d::Backend adapter. It validates tensors (contiguous, device,
// dtype, sizes), turns each call into core ops on the group's Communicator and returns a
// WorkResident (none for a synchronous call, which has waited). Works are kept alive here until
// their ops finished, so dropping an async Work never frees tensors the op still writes. The
// all-to-all family is in process_group_alltoall.cpp, the rooted ops (broadcast, reduce, gather,
// scatter) in process_group_rooted.cpp, the argument checks in call_checks.hpp.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "c10d/call_checks.hpp"
#include "c10d/handoff.hpp"
#include "c10d/synchronous_call.hpp"
#include "c10d/work_cuda.hpp"
#include "c10d/work_resident.hpp"
#include "core/communicator.hpp"

namespace resident {

class ProcessGroupResident : public c10d::Backend {
 public:
  ProcessGroupResident(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout,
                       const std::map<std::string, std::string>& options,
                       const std::vector<int>& global_ranks = {});
  ~ProcessGroupResident() override;

  const std::string getBackendName() const override { return "resident"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  // A virtual of c10d::Backend since torch 2.14 (overridden there); not yet in torch 2.11, where
  // it is only this class's method: no `override`, so that both build.
  c10::intrusive_ptr<c10d::Work> gather_into_tensor(  // NOLINT(modernize-use-override)
      at::Tensor& output, at::Tensor& input, const c10d::GatherOptions& opts);
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  // all_to_all of capacity buffers `input` and `output` ([size, max_rows, ...], equal shapes and
  // dtypes) moving only send_rows[p] rows to peer p and recv_rows[p] rows from it (1-D int32 or
  // int64 tensors of `size` entries on the tensors' device, clamped to [0, max_rows]). On CUDA
  // the kernel reads the counts when it runs (graph-capturable, no host sync); on CPU they are
  // read at the call. Rows past the counts keep their contents. counts_out (CUDA): recv_rows is
  // written, from counts that travel ahead of each peer's rows. Resident only
  // (resident_pg/ep.py).
  c10::intrusive_ptr<c10d::Work> allToAllDeviceSplits(at::Tensor& output, at::Tensor& input,
                                                      const at::Tensor& send_rows,
                                                      const at::Tensor& recv_rows, bool async_op,
                                                      bool counts_out);
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  // The number of collectives this group has issued (send and recv do not count, as in
  // ProcessGroupNCCL): equal on ranks that issued the same collectives, which torch's
  // TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper checks before each one.
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  // It starts at 0 on every rank when the group is created: nothing to agree on.
  void setSequenceNumberForGroup() override {}

  void setTimeout(std::chrono::milliseconds timeout) override;
  void abort() override;
  void shutdown() override;
  // SUCCESS, TIMEOUT (this rank gave up waiting), REMOTE_ERROR (a peer died, or its group or
  // connection failed: known between ops too, once its death was noticed), COMM_ERROR; then the
  // hand-off backend's.
  c10d::ErrorType getError() override;

  // Introspection: per-peer transport and path, the configuration, the proxy's CPU.
  std::string transportFor(int peer) const { return comm_->transportFor(peer); }
  std::string pathFor(int peer) const { return comm_->pathFor(peer); }
  std::string describeConfig() const { return comm_->config().describe(); }
  int proxyCpu() const { return comm_->proxyCpu(); }
  std::string tcpEndpoint() const { return comm_->tcpEndpoint(); }

  // The large-message hand-off (c10d/handoff.hpp): ops on `device` tensors whose bytes reach
  // crossover_bytes[op kind] go to `inner`; kinds left out stay resident. Set it on every rank
  // alike, before the group's first op.
  void setHandoff(c10::intrusive_ptr<c10d::Backend> inner, const std::string& device,
                  const std::map<std::string, uint64_t>& crossover_bytes);
  void setHandoffOff(const std::string& reason) { handoff_.disable(reason); }
  const Handoff& handoff() const { return handoff_; }
  uint64_t handoffBytes() const { return comm_->config().handoff_bytes; }

 private:
  // A CPU op: `add(OpList&)` starts its core ops (several for a coalesced call), after every
  // check. A synchronous call (synchronousCall: torch's calls without async_op) waits for them
  // here and returns no Work, making none (its allocations and atomics cost 0.05-0.48 µs per
  // 8 B call on the 2-core machine, docs/decisions.md); otherwise they go into a WorkResident
  // kept in inflight_ until they finished.
  template <typename F>
  c10::intrusive_ptr<c10d::Work> cpuOp(c10d::OpType type, const char* title,
                                       c10::ArrayRef<at::Tensor> outputs,
                                       c10::ArrayRef<at::Tensor> keep_alive, bool async_op,
                                       F&& add);
  // Waits for a synchronous call's ops on this thread; raises the first failed op's error as
  // WorkResident::wait does.
  void waitSynchronous(const OpList& ops);
  // Drops the works whose ops finished from inflight_ and gives their ops back to the pool
  // (a work the caller still holds keeps its outcome). Also the engine's reclaim hook, run
  // while a new op waits for a free one.
  void dropFinished();
  static void reclaimFinished(void* self) {
    static_cast<ProcessGroupResident*>(self)->dropFinished();
  }
  // A CPU all_to_all of per-peer regions (Communicator::allToAll).
  c10::intrusive_ptr<c10d::Work> cpuAllToAll(c10d::OpType type, const char* title,
                                             c10::ArrayRef<at::Tensor> outputs,
                                             c10::ArrayRef<at::Tensor> inputs,
                                             const void* const* ins, const size_t* in_bytes,
                                             void* const* outs, const size_t* out_bytes,
                                             bool async_op);
  void checkAllGatherBase(const at::Tensor& output, const at::Tensor& input);
  void checkReduceScatterBase(const at::Tensor& output, const at::Tensor& input);
  // all_gather_into_tensor of each (output, input) pair, CPU or CUDA.
  c10::intrusive_ptr<c10d::Work> allGatherBase(c10d::OpType type, const char* title,
                                               const std::vector<at::Tensor>& outputs,
                                               const std::vector<at::Tensor>& inputs,
                                               bool async_op);
  // reduce_scatter_tensor of each (output, input) pair, CPU or CUDA.
  c10::intrusive_ptr<c10d::Work> reduceScatterBase(c10d::OpType type, const char* title,
                                                   const std::vector<at::Tensor>& outputs,
                                                   const std::vector<at::Tensor>& inputs,
                                                   const c10d::ReduceScatterOptions& opts);

  // Forwards an op to the hand-off backend (counted as a collective unless it is a send/recv).
  template <typename F>
  c10::intrusive_ptr<c10d::Work> handOff(HandoffOp op, const char* title,
                                         c10::ArrayRef<at::Tensor> inputs, F&& call);

  // CUDA tensors: one kernel on a stream (csrc/c10d/work_cuda.cpp).
  template <typename F>
  c10::intrusive_ptr<c10d::Work> cudaOp(c10d::OpType type, const char* title,
                                        const std::vector<at::Tensor>& outputs,
                                        const std::vector<at::Tensor>& inputs, bool async_op,
                                        F&& launch);

  std::shared_ptr<Communicator> comm_;
  std::vector<c10::intrusive_ptr<WorkResident>> inflight_;
  std::unique_ptr<CudaPath> cuda_;  // CUDA tensors' ops (its GPU state made on the first)
  uint64_t timeout_ms_ = 0;
  uint64_t seq_ = 0;  // collectives issued (getSequenceNumberForGroup)
  Handoff handoff_;
};

// The op paths shared by the adapter's files (process_group_resident.cpp,
// process_group_alltoall.cpp, process_group_rooted.cpp).
template <typename F>
c10::intrusive_ptr<c10d::Work> ProcessGroupResident::cudaOp(c10d::OpType type, const char* title,
                                                            const std::vector<at::Tensor>& outputs,
                                                            const std::vector<at::Tensor>& inputs,
                                                            bool async_op, F&& launch) {
  auto work = translateErrors(
      [&] { return cuda_->collective(type, title, outputs, inputs, async_op, launch); });
  ++seq_;
  return work;
}

template <typename F>
c10::intrusive_ptr<c10d::Work> ProcessGroupResident::cpuOp(c10d::OpType type, const char* title,
                                                           c10::ArrayRef<at::Tensor> outputs,
                                                           c10::ArrayRef<at::Tensor> keep_alive,
                                                           bool async_op, F&& add) {
  flushPendingP2P();  // a CUDA send/recv called before this op runs before it
  dropFinished();     // works whose ops finished leave inflight_, their ops go back to the pool
  const bool counted = !c10d::isP2POp(type);  // getSequenceNumberForGroup counts collectives
  if (synchronousCall(async_op)) {
    OpRecord record =
        OpRecord::start(title, WorkResident::recordedInputs(type, outputs, keep_alive));
    c10::SmallVector<OpHandle, 4> ops;
    struct Release {  // also when starting or waiting throws
      Engine& engine;
      OpList& ops;
      ~Release() {
        for (const OpHandle& h : ops) engine.release(h);
      }
    } release{comm_->engine(), ops};
    translateErrors([&] {
      add(static_cast<OpList&>(ops));
      return 0;
    });
    if (counted) ++seq_;
    waitSynchronous(ops);
    return {};
  }
  auto work =
      c10::make_intrusive<WorkResident>(comm_, rank_, type, title, outputs.vec(), keep_alive.vec());
  translateErrors([&] {
    add(work->ops());
    return 0;
  });
  if (counted) ++seq_;
  inflight_.push_back(work);
  return work;
}

template <typename F>
c10::intrusive_ptr<c10d::Work> ProcessGroupResident::handOff(HandoffOp op, const char* title,
                                                             c10::ArrayRef<at::Tensor> inputs,
                                                             F&& call) {
  flushPendingP2P();  // a CUDA send/recv called before this op runs before it
  auto work = handoff_.forward(op, title, inputs, std::forward<F>(call));
  if (op != HandoffOp::kSendRecv) ++seq_;
  return work;
}

}  // namespace resident
