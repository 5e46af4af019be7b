#include "c10d/process_group_resident.hpp"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <string>

#include "c10d/store_bootstrap.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace resident {

ProcessGroupResident::ProcessGroupResident(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                           int size, std::chrono::milliseconds timeout,
                                           const std::map<std::string, std::string>& options,
                                           const std::vector<int>& global_ranks)
    : c10d::Backend(rank, size) {
  translateErrors([&] {
    Config cfg = Config::fromEnvironment(options);
    // Carry a GPU region in the segment when this process can run the CUDA path.
    cfg.gpu_region = cudaPathBuilt() && at::hasCUDA();
    C10dStoreBootstrap bootstrap(store);
    comm_ = std::make_shared<Communicator>(bootstrap, rank, size, cfg,
                                           static_cast<uint64_t>(timeout.count()), global_ranks);
    inflight_.reserve(cfg.max_inflight);
    comm_->engine().setReclaim(&ProcessGroupResident::reclaimFinished, this);
    timeout_ms_ = static_cast<uint64_t>(timeout.count());
    cuda_ = std::make_unique<CudaPath>(*comm_, rank, timeout_ms_);
    return 0;
  });
}

void ProcessGroupResident::setHandoff(c10::intrusive_ptr<c10d::Backend> inner,
                                      const std::string& device,
                                      const std::map<std::string, uint64_t>& crossover_bytes) {
  RESIDENT_CHECK_VALUE(inner.defined(), "resident: the hand-off backend is None");
  RESIDENT_CHECK_VALUE(inner.get() != this, "resident: a group cannot hand off to itself");
  RESIDENT_CHECK_VALUE(inner->getSize() == size_ && inner->getRank() == rank_,
                       "resident: the hand-off backend has rank ", inner->getRank(), " of ",
                       inner->getSize(), ", this group rank ", rank_, " of ", size_);
  RESIDENT_CHECK_VALUE(device == "cpu" || device == "cuda", "resident: hand-off device '", device,
                       "' is not 'cpu' or 'cuda'");
  std::array<uint64_t, kHandoffOps> crossover{};
  for (const auto& kv : crossover_bytes) {
    int i = 0;
    while (i < kHandoffOps && kv.first != kHandoffOpNames[static_cast<size_t>(i)]) ++i;
    if (i == kHandoffOps) {
      std::string known;
      for (const char* name : kHandoffOpNames)
        known += (known.empty() ? "" : ", ") + std::string(name);
      C10_THROW_ERROR(ValueError, cat("resident: hand-off op kind '", kv.first,
                                      "' is unknown (known: ", known, ")"));
    }
    crossover[static_cast<size_t>(i)] = kv.second;
  }
  handoff_.install(std::move(inner), device == "cpu" ? c10::DeviceType::CPU : c10::DeviceType::CUDA,
                   crossover);
}

ProcessGroupResident::~ProcessGroupResident() {
  ProcessGroupResident::shutdown();  // this class's own: no virtual dispatch in a destructor
}

void ProcessGroupResident::setTimeout(std::chrono::milliseconds timeout) {
  comm_->engine().setTimeoutNs(static_cast<uint64_t>(timeout.count()) * 1000000ull);
  timeout_ms_ = static_cast<uint64_t>(timeout.count());
  cuda_->setTimeoutMs(timeout_ms_);
  if (handoff_.on()) handoff_.inner()->setTimeout(timeout);
}

void ProcessGroupResident::abort() {
  if (handoff_.on()) {
    try {
      handoff_.inner()->abort();
    } catch (const std::exception& e) {
      RLOG_WARN("the hand-off backend's abort failed: %s", e.what());
    }
    handoff_.disable("the group was aborted");  // aborted: shutdown() leaves it alone
  }
  shutdown();
}

void ProcessGroupResident::shutdown() {
  if (!comm_) return;
  comm_->engine().setReclaim(nullptr, nullptr);  // the communicator may outlive this object
  cuda_->shutdown();                             // before the segments it registered go away
  comm_->shutdown();  // fails what is in flight, stops the proxy, unmaps segments
  for (const auto& work : inflight_) work->endRecord();  // aborted: their profiler events end
  inflight_.clear();
  if (handoff_.on()) {
    // Also reached from the destructor, which must not throw: a failing inner shutdown is logged.
    try {
      handoff_.inner()->shutdown();
    } catch (const std::exception& e) {
      RLOG_WARN("the hand-off backend's shutdown failed: %s", e.what());
    }
    handoff_.disable("the group was shut down");
  }
}

c10d::ErrorType ProcessGroupResident::getError() {
  switch (comm_->error()) {
    case GroupError::kTimeout:
      return c10d::ErrorType::TIMEOUT;
    case GroupError::kRemote:
      return c10d::ErrorType::REMOTE_ERROR;
    case GroupError::kComm:
      return c10d::ErrorType::COMM_ERROR;
    case GroupError::kNone:
      break;
  }
  if (!handoff_.on()) return c10d::ErrorType::SUCCESS;
  try {
    return handoff_.inner()->getError();
  } catch (const std::exception&) {  // a backend without getError (gloo before torch 2.14)
    return c10d::ErrorType::SUCCESS;
  }
}

void ProcessGroupResident::dropFinished() {
  inflight_.erase(std::remove_if(inflight_.begin(), inflight_.end(),
                                 [](const c10::intrusive_ptr<WorkResident>& w) {
                                   if (!w->completedNow()) return false;
                                   w->releaseOps();
                                   return true;
                                 }),
                  inflight_.end());
}

void ProcessGroupResident::waitSynchronous(const OpList& ops) {
  WorkResident::waitOps(comm_->engine(), ops, 0);
  for (const OpHandle& h : ops)  // the first failed op's error, as WorkResident::wait raises it
    if (h.op->state.load(std::memory_order_acquire) == OpState::kFailed)
      C10_THROW_ERROR(DistBackendError, h.op->error);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = single(tensors, "all_reduce");
  const Reduction red = reductionOf(t, opts.reduceOp, "all_reduce");
  if (handoff_.takes(HandoffOp::kAllReduce, t, nbytes(t)))
    return handOff(HandoffOp::kAllReduce, "resident:all_reduce", tensors,
                   [&](c10d::Backend& b) { return b.allreduce(tensors, opts); });
  if (t.is_cuda()) {
    return cudaOp(c10d::OpType::ALLREDUCE, "resident:all_reduce", tensors, tensors, opts.asyncOp,
                  [&](GpuCommunicator& g, void* s) {
                    g.allReduce(t.data_ptr(), t.data_ptr(), red.count(t), red.dtype, red.op, s);
                  });
  }
  return cpuOp(c10d::OpType::ALLREDUCE, "resident:all_reduce", tensors, {}, opts.asyncOp,
               [&](OpList& ops) {
                 ops.push_back(
                     comm_->allReduce(t.data_ptr(), t.data_ptr(), red.count(t), red.dtype, red.op));
               });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  // Validate everything before starting anything: a partial start would desynchronise ranks.
  c10::SmallVector<Reduction, 8> reds;
  for (const auto& t : tensors) {
    checkTensor(t, "all_reduce_coalesced");
    reds.push_back(reductionOf(t, opts.reduceOp, "all_reduce_coalesced"));
  }
  if (!tensors.empty() && tensors[0].is_cuda()) {
    for (const auto& t : tensors) checkSameKind(tensors[0], t, "all_reduce_coalesced", "a tensor");
    return cudaOp(c10d::OpType::ALLREDUCE_COALESCED, "resident:all_reduce_coalesced", tensors,
                  tensors, opts.asyncOp, [&](GpuCommunicator& g, void* s) {
                    for (const auto i : c10::irange(tensors.size()))
                      g.allReduce(tensors[i].data_ptr(), tensors[i].data_ptr(),
                                  reds[i].count(tensors[i]), reds[i].dtype, reds[i].op, s);
                  });
  }
  return cpuOp(c10d::OpType::ALLREDUCE_COALESCED, "resident:all_reduce_coalesced", tensors, {},
               opts.asyncOp, [&](OpList& ops) {
                 for (const auto i : c10::irange(tensors.size())) {
                   at::Tensor& t = tensors[i];
                   ops.push_back(comm_->allReduce(t.data_ptr(), t.data_ptr(), reds[i].count(t),
                                                  reds[i].dtype, reds[i].op));
                 }
               });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const at::Tensor& in = single(inputs, "all_gather");
  RESIDENT_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_),
                       "resident: all_gather needs one output list of ", size_, " tensors");
  c10::SmallVector<void*, 16> outs;
  for (const auto i : c10::irange(outputs[0].size())) {
    const at::Tensor& o = outputs[0][i];
    checkSameKind(in, o, "all_gather", "an output tensor");
    RESIDENT_CHECK_VALUE(o.numel() == in.numel(), "resident: all_gather: output tensor ", i,
                         " has ", o.numel(), " elements but the input has ", in.numel(),
                         " (size mismatch)");
    outs.push_back(o.data_ptr());
  }
  if (in.is_cuda()) {
    return cudaOp(c10d::OpType::ALLGATHER, "resident:all_gather", outputs[0], inputs, opts.asyncOp,
                  [&](GpuCommunicator& g, void* s) {
                    g.allGather(in.data_ptr(), outs.data(), nbytes(in), s);
                  });
  }
  return cpuOp(c10d::OpType::ALLGATHER, "resident:all_gather", outputs[0], inputs, opts.asyncOp,
               [&](OpList& ops) {
                 ops.push_back(comm_->allGather(in.data_ptr(), outs.data(), nbytes(in)));
               });
}

void ProcessGroupResident::checkAllGatherBase(const at::Tensor& output, const at::Tensor& input) {
  checkTensor(input, "all_gather_into_tensor");
  checkSameKind(input, output, "all_gather_into_tensor", "the output");
  RESIDENT_CHECK_VALUE(output.numel() == input.numel() * size_,
                       "resident: all_gather_into_tensor: output has ", output.numel(),
                       " elements, expected world size x input = ", input.numel() * size_,
                       " (size mismatch)");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::allGatherBase(
    c10d::OpType type, const char* title, const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs, bool async_op) {
  // Every pair checked before any op starts: a partial start would desynchronise ranks.
  for (const auto i : c10::irange(inputs.size())) checkAllGatherBase(outputs[i], inputs[i]);
  // Rank p's input lands at p x input bytes into the output.
  auto rankOffsets = [&](size_t i) {
    c10::SmallVector<void*, 16> outs;
    auto* base = static_cast<unsigned char*>(outputs[i].data_ptr());
    for (int p = 0; p < size_; ++p) outs.push_back(base + p * nbytes(inputs[i]));
    return outs;
  };
  if (!inputs.empty() && inputs[0].is_cuda()) {
    return cudaOp(type, title, outputs, inputs, async_op, [&](GpuCommunicator& g, void* s) {
      for (const auto i : c10::irange(inputs.size()))
        g.allGather(inputs[i].data_ptr(), rankOffsets(i).data(), nbytes(inputs[i]), s);
    });
  }
  return cpuOp(type, title, outputs, inputs, async_op, [&](OpList& ops) {
    for (const auto i : c10::irange(inputs.size()))
      ops.push_back(
          comm_->allGather(inputs[i].data_ptr(), rankOffsets(i).data(), nbytes(inputs[i])));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  if (handoff_.takes(HandoffOp::kAllGatherIntoTensor, input, nbytes(input))) {
    checkAllGatherBase(output, input);  // the resident paths check it below
    // Flat views: any shapes of equal element counts are accepted here (e.g. an output stacked
    // as [world size, n]); some backends (gloo) also compare shapes.
    at::Tensor out = output.view(-1), in = input.view(-1);
    return handOff(HandoffOp::kAllGatherIntoTensor, "resident:all_gather_into_tensor", input,
                   [&](c10d::Backend& b) { return b._allgather_base(out, in, opts); });
  }
  return allGatherBase(c10d::OpType::_ALLGATHER_BASE, "resident:all_gather_into_tensor", {output},
                       {input}, opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  RESIDENT_CHECK_VALUE(outputs.size() == inputs.size(),
                       "resident: all_gather_into_tensor_coalesced: ", outputs.size(),
                       " outputs for ", inputs.size(), " inputs");
  return allGatherBase(c10d::OpType::COALESCED, "resident:all_gather_into_tensor_coalesced",
                       outputs, inputs, opts.asyncOp);
}

// outputs[r][i] receives rank r's inputs[i]; each input is gathered as its own op (dtypes and
// sizes may differ between inputs), all in one Work.
c10::intrusive_ptr<c10d::Work> ProcessGroupResident::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "all_gather_coalesced";
  RESIDENT_CHECK_VALUE(output_lists.size() == static_cast<size_t>(size_), "resident: ", op,
                       " needs one output list per rank (", size_, "), got ", output_lists.size());
  // Validate everything before starting anything: a partial start would desynchronise ranks.
  std::vector<c10::SmallVector<void*, 16>> outs(inputs.size());
  std::vector<at::Tensor> flat_outputs;
  for (const auto i : c10::irange(inputs.size())) {
    checkTensor(inputs[i], op);
    RESIDENT_CHECK_VALUE(inputs[i].device() == inputs[0].device(), "resident: ", op, ": input ", i,
                         " is on ", inputs[i].device(), " but input 0 is on ", inputs[0].device(),
                         " (device mix)");
  }
  for (const auto r : c10::irange(output_lists.size())) {
    RESIDENT_CHECK_VALUE(output_lists[r].size() == inputs.size(), "resident: ", op,
                         ": output list ", r, " has ", output_lists[r].size(), " tensors for ",
                         inputs.size(), " inputs");
    for (const auto i : c10::irange(inputs.size())) {
      const at::Tensor& o = output_lists[r][i];
      checkSameKind(inputs[i], o, op, "an output tensor");
      RESIDENT_CHECK_VALUE(o.numel() == inputs[i].numel(), "resident: ", op, ": output ", r, "/", i,
                           " has ", o.numel(), " elements but input ", i, " has ",
                           inputs[i].numel(), " (size mismatch)");
      outs[i].push_back(o.data_ptr());
      flat_outputs.push_back(o);
    }
  }
  if (!inputs.empty() && inputs[0].is_cuda()) {
    return cudaOp(c10d::OpType::ALLGATHER_COALESCED, "resident:all_gather_coalesced", flat_outputs,
                  inputs, opts.asyncOp, [&](GpuCommunicator& g, void* s) {
                    for (const auto i : c10::irange(inputs.size()))
                      g.allGather(inputs[i].data_ptr(), outs[i].data(), nbytes(inputs[i]), s);
                  });
  }
  return cpuOp(
      c10d::OpType::ALLGATHER_COALESCED, "resident:all_gather_coalesced", flat_outputs, inputs,
      opts.asyncOp, [&](OpList& ops) {
        for (const auto i : c10::irange(inputs.size()))
          ops.push_back(comm_->allGather(inputs[i].data_ptr(), outs[i].data(), nbytes(inputs[i])));
      });
}

void ProcessGroupResident::checkReduceScatterBase(const at::Tensor& output,
                                                  const at::Tensor& input) {
  checkTensor(output, "reduce_scatter_tensor");
  checkSameKind(output, input, "reduce_scatter_tensor", "the input");
  RESIDENT_CHECK_VALUE(input.numel() == output.numel() * size_,
                       "resident: reduce_scatter_tensor: input has ", input.numel(),
                       " elements, expected world size x output = ", output.numel() * size_,
                       " (size mismatch)");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::reduceScatterBase(
    c10d::OpType type, const char* title, const std::vector<at::Tensor>& outputs,
    const std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  // Every pair checked before any op starts: a partial start would desynchronise ranks.
  c10::SmallVector<Reduction, 8> reds;
  for (const auto i : c10::irange(inputs.size())) {
    checkReduceScatterBase(outputs[i], inputs[i]);
    reds.push_back(reductionOf(outputs[i], opts.reduceOp, "reduce_scatter_tensor"));
  }
  if (!inputs.empty() && inputs[0].is_cuda()) {
    return cudaOp(type, title, outputs, inputs, opts.asyncOp, [&](GpuCommunicator& g, void* s) {
      for (const auto i : c10::irange(inputs.size()))
        g.reduceScatter(inputs[i].data_ptr(), outputs[i].data_ptr(), reds[i].count(outputs[i]),
                        reds[i].dtype, reds[i].op, s);
    });
  }
  return cpuOp(type, title, outputs, inputs, opts.asyncOp, [&](OpList& ops) {
    for (const auto i : c10::irange(inputs.size()))
      ops.push_back(comm_->reduceScatter(inputs[i].data_ptr(), outputs[i].data_ptr(),
                                         reds[i].count(outputs[i]), reds[i].dtype, reds[i].op));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  if (handoff_.takes(HandoffOp::kReduceScatterTensor, output, nbytes(output))) {
    checkReduceScatterBase(output, input);  // the resident paths check these below
    reductionOf(output, opts.reduceOp, "reduce_scatter_tensor");
    at::Tensor out = output.view(-1), in = input.view(-1);  // flat: as all_gather_into_tensor
    return handOff(HandoffOp::kReduceScatterTensor, "resident:reduce_scatter_tensor", input,
                   [&](c10d::Backend& b) { return b._reduce_scatter_base(out, in, opts); });
  }
  return reduceScatterBase(c10d::OpType::_REDUCE_SCATTER_BASE, "resident:reduce_scatter_tensor",
                           {output}, {input}, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  RESIDENT_CHECK_VALUE(outputs.size() == inputs.size(),
                       "resident: reduce_scatter_tensor_coalesced: ", outputs.size(),
                       " outputs for ", inputs.size(), " inputs");
  return reduceScatterBase(c10d::OpType::COALESCED, "resident:reduce_scatter_tensor_coalesced",
                           outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = single(outputs, "reduce_scatter");
  RESIDENT_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
                       "resident: reduce_scatter needs one input list of ", size_, " tensors");
  c10::SmallVector<const void*, 16> ins;
  for (const auto i : c10::irange(inputs[0].size())) {
    const at::Tensor& t = inputs[0][i];
    checkSameKind(out, t, "reduce_scatter", "an input tensor");
    RESIDENT_CHECK_VALUE(t.numel() == out.numel(), "resident: reduce_scatter: input tensor ", i,
                         " has ", t.numel(), " elements but the output has ", out.numel(),
                         " (size mismatch)");
    ins.push_back(t.data_ptr());
  }
  const Reduction red = reductionOf(out, opts.reduceOp, "reduce_scatter");
  if (out.is_cuda()) {
    return cudaOp(c10d::OpType::REDUCE_SCATTER, "resident:reduce_scatter", outputs, inputs[0],
                  opts.asyncOp, [&](GpuCommunicator& g, void* s) {
                    g.reduceScatterV(ins.data(), out.data_ptr(), red.count(out), red.dtype, red.op,
                                     s);
                  });
  }
  return cpuOp(c10d::OpType::REDUCE_SCATTER, "resident:reduce_scatter", outputs, inputs[0],
               opts.asyncOp, [&](OpList& ops) {
                 ops.push_back(comm_->reduceScatterV(ins.data(), out.data_ptr(), red.count(out),
                                                     red.dtype, red.op));
               });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::send(std::vector<at::Tensor>& tensors, int dst,
                                                          int tag) {
  const at::Tensor& t = single(tensors, "send");
  if (handoff_.takes(HandoffOp::kSendRecv, t, nbytes(t)))
    return handOff(HandoffOp::kSendRecv, "resident:send", tensors,
                   [&](c10d::Backend& b) { return b.send(tensors, dst, tag); });
  if (t.is_cuda()) {
    return translateErrors(
        [&] { return cuda_->pointToPoint(c10d::OpType::SEND, "resident:send", t, true, dst); });
  }
  return cpuOp(c10d::OpType::SEND, "resident:send", {}, tensors, true, [&](OpList& ops) {
    ops.push_back(comm_->send(t.data_ptr(), nbytes(t), dst, static_cast<uint64_t>(tag)));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::recv(std::vector<at::Tensor>& tensors, int src,
                                                          int tag) {
  const at::Tensor& t = single(tensors, "recv");
  if (handoff_.takes(HandoffOp::kSendRecv, t, nbytes(t)))
    return handOff(HandoffOp::kSendRecv, "resident:recv", tensors,
                   [&](c10d::Backend& b) { return b.recv(tensors, src, tag); });
  if (t.is_cuda()) {
    return translateErrors(
        [&] { return cuda_->pointToPoint(c10d::OpType::RECV, "resident:recv", t, false, src); });
  }
  return cpuOp(c10d::OpType::RECV, "resident:recv", tensors, {}, true, [&](OpList& ops) {
    ops.push_back(comm_->recv(t.data_ptr(), nbytes(t), src, static_cast<uint64_t>(tag)));
  });
}

// The engine matches the oldest message with this tag from whichever peer; the Work's
// sourceRank() names that peer. CUDA tensors: the device-side channels pair messages per peer
// in issue order (as NCCL, which has no any-source receive either), so a kernel cannot wait on
// "whichever peer sends first".
c10::intrusive_ptr<c10d::Work> ProcessGroupResident::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                   int tag) {
  const at::Tensor& t = single(tensors, "recv from any source");
  RESIDENT_CHECK_VALUE(!t.is_cuda(),
                       "resident: recv from any source is not supported on CUDA tensors (the "
                       "CUDA path pairs each peer's messages in issue order on the device); "
                       "pass src, or receive into a CPU tensor");
  return cpuOp(
      c10d::OpType::RECVANYSOURCE, "resident:recvAnySource", tensors, {}, true, [&](OpList& ops) {
        ops.push_back(comm_->recvAnySource(t.data_ptr(), nbytes(t), static_cast<uint64_t>(tag)));
      });
}

// A barrier is a host-level synchronisation (torch hands non-NCCL backends a CPU tensor):
// it always takes the CPU path, also in groups that move CUDA tensors.
c10::intrusive_ptr<c10d::Work> ProcessGroupResident::barrier(const c10d::BarrierOptions& opts) {
  return cpuOp(c10d::OpType::BARRIER, "resident:barrier", {}, {}, opts.asyncOp,
               [&](OpList& ops) { ops.push_back(comm_->barrier()); });
}

// Host-side like barrier(); blocking, as torch's monitored_barrier is.
void ProcessGroupResident::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  const uint64_t timeout_ms =
      opts.timeout == c10d::kUnsetTimeout
          ? timeout_ms_
          : static_cast<uint64_t>(std::max<int64_t>(0, opts.timeout.count()));
  translateErrors([&] {
    comm_->monitoredBarrier(timeout_ms, wait_all_ranks);
    return 0;
  });
}

}  // namespace resident
