// ProcessGroupResident's rooted ops: broadcast and reduce (one root's tensor to or from every
// rank), gather (every rank's input to the root, as a list or one tensor) and scatter.
#include "c10d/process_group_resident.hpp"

#include <c10/util/irange.h>

#include <vector>

namespace resident {

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = single(tensors, "broadcast");
  if (handoff_.takes(HandoffOp::kBroadcast, t, nbytes(t)))
    return handOff(HandoffOp::kBroadcast, "resident:broadcast", tensors,
                   [&](c10d::Backend& b) { return b.broadcast(tensors, opts); });
  if (t.is_cuda()) {
    return cudaOp(c10d::OpType::BROADCAST, "resident:broadcast", tensors, tensors, opts.asyncOp,
                  [&](GpuCommunicator& g, void* s) {
                    g.broadcast(t.data_ptr(), nbytes(t), static_cast<int>(opts.rootRank), s);
                  });
  }
  return cpuOp(
      c10d::OpType::BROADCAST, "resident:broadcast", tensors, {}, opts.asyncOp, [&](OpList& ops) {
        ops.push_back(comm_->broadcast(t.data_ptr(), nbytes(t), static_cast<int>(opts.rootRank)));
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  const at::Tensor& t = single(tensors, "reduce");
  const Reduction red = reductionOf(t, opts.reduceOp, "reduce");
  if (t.is_cuda()) {
    return cudaOp(c10d::OpType::REDUCE, "resident:reduce", tensors, tensors, opts.asyncOp,
                  [&](GpuCommunicator& g, void* s) {
                    g.reduce(t.data_ptr(), t.data_ptr(), red.count(t), red.dtype, red.op,
                             static_cast<int>(opts.rootRank), s);
                  });
  }
  return cpuOp(c10d::OpType::REDUCE, "resident:reduce", tensors, {}, opts.asyncOp,
               [&](OpList& ops) {
                 ops.push_back(comm_->reduce(t.data_ptr(), t.data_ptr(), red.count(t), red.dtype,
                                             red.op, static_cast<int>(opts.rootRank)));
               });
}

// The root's output holds every rank's input one after another (torch's gather_single).
c10::intrusive_ptr<c10d::Work> ProcessGroupResident::gather_into_tensor(
    at::Tensor& output, at::Tensor& input, const c10d::GatherOptions& opts) {
  const char* op = "gather_single";
  checkTensor(input, op);
  const int root = static_cast<int>(opts.rootRank);
  c10::SmallVector<void*, 16> outs(static_cast<size_t>(size_), nullptr);
  std::vector<at::Tensor> result;
  if (rank_ == root) {
    checkSameKind(input, output, op, "the output");
    RESIDENT_CHECK_VALUE(
        output.numel() == input.numel() * size_, "resident: ", op, ": output has ", output.numel(),
        " elements, expected world size x input = ", input.numel() * size_, " (size mismatch)");
    auto* base = static_cast<unsigned char*>(output.data_ptr());
    for (int p = 0; p < size_; ++p) outs[static_cast<size_t>(p)] = base + p * nbytes(input);
    result.push_back(output);
  }
  if (input.is_cuda()) {
    return cudaOp(c10d::OpType::GATHER, "resident:gather_single", result, {input}, opts.asyncOp,
                  [&](GpuCommunicator& g, void* s) {
                    g.gather(input.data_ptr(), outs.data(), nbytes(input), root, s);
                  });
  }
  return cpuOp(c10d::OpType::GATHER, "resident:gather_single", result, {input}, opts.asyncOp,
               [&](OpList& ops) {
                 ops.push_back(comm_->gather(input.data_ptr(), outs.data(), nbytes(input), root));
               });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const at::Tensor& in = single(inputs, "gather");
  const int root = static_cast<int>(opts.rootRank);
  c10::SmallVector<void*, 16> outs(static_cast<size_t>(size_), nullptr);
  std::vector<at::Tensor> result;
  if (rank_ == root) {
    RESIDENT_CHECK_VALUE(outputs.size() == 1 && outputs[0].size() == static_cast<size_t>(size_),
                         "resident: gather: the root needs one output list of ", size_, " tensors");
    for (const auto i : c10::irange(outputs[0].size())) {
      const at::Tensor& o = outputs[0][i];
      checkSameKind(in, o, "gather", "an output tensor");
      RESIDENT_CHECK_VALUE(o.numel() == in.numel(), "resident: gather: output tensor ", i, " has ",
                           o.numel(), " elements but the input has ", in.numel(),
                           " (size mismatch)");
      outs[i] = o.data_ptr();
    }
    result = outputs[0];
  } else {
    RESIDENT_CHECK_VALUE(outputs.empty() || outputs[0].empty(),
                         "resident: gather: only the root passes output tensors");
  }
  if (in.is_cuda()) {
    return cudaOp(c10d::OpType::GATHER, "resident:gather", result, inputs, opts.asyncOp,
                  [&](GpuCommunicator& g, void* s) {
                    g.gather(in.data_ptr(), outs.data(), nbytes(in), root, s);
                  });
  }
  return cpuOp(c10d::OpType::GATHER, "resident:gather", result, inputs, opts.asyncOp,
               [&](OpList& ops) {
                 ops.push_back(comm_->gather(in.data_ptr(), outs.data(), nbytes(in), root));
               });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const at::Tensor& out = single(outputs, "scatter");
  const int root = static_cast<int>(opts.rootRank);
  c10::SmallVector<const void*, 16> ins(static_cast<size_t>(size_), nullptr);
  std::vector<at::Tensor> keep;
  if (rank_ == root) {
    RESIDENT_CHECK_VALUE(inputs.size() == 1 && inputs[0].size() == static_cast<size_t>(size_),
                         "resident: scatter: the root needs one input list of ", size_, " tensors");
    for (const auto i : c10::irange(inputs[0].size())) {
      const at::Tensor& t = inputs[0][i];
      checkSameKind(out, t, "scatter", "an input tensor");
      RESIDENT_CHECK_VALUE(t.numel() == out.numel(), "resident: scatter: input tensor ", i, " has ",
                           t.numel(), " elements but the output has ", out.numel(),
                           " (size mismatch)");
      ins[i] = t.data_ptr();
    }
    keep = inputs[0];
  }
  if (out.is_cuda()) {
    return cudaOp(c10d::OpType::SCATTER, "resident:scatter", outputs, keep, opts.asyncOp,
                  [&](GpuCommunicator& g, void* s) {
                    g.scatter(ins.data(), out.data_ptr(), nbytes(out), root, s);
                  });
  }
  return cpuOp(c10d::OpType::SCATTER, "resident:scatter", outputs, keep, opts.asyncOp,
               [&](OpList& ops) {
                 ops.push_back(comm_->scatter(ins.data(), out.data_ptr(), nbytes(out), root));
               });
}

}  // namespace resident
