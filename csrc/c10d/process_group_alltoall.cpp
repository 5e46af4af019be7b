// ProcessGroupResident's all-to-all family: all_to_all_single (equal or given splits),
// all_to_all of tensor lists, and the resident-only all_to_all_device_splits of EP, whose row
// counts are tensors read by the kernel (docs/ep.md).
#include "c10d/process_group_resident.hpp"

#include <c10/util/irange.h>

#include <algorithm>

namespace resident {

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
    std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  checkTensor(input, "all_to_all_single");
  checkSameKind(input, output, "all_to_all_single", "the output");
  // Split sizes count rows of dim 0; empty means equal splits.
  auto rowBytes = [](const at::Tensor& t) -> size_t {
    return t.dim() == 0 || t.size(0) == 0 ? 0 : nbytes(t) / static_cast<size_t>(t.size(0));
  };
  auto layoutOf = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what,
                      c10::SmallVector<size_t, 16>& bytes, c10::SmallVector<size_t, 16>& offs) {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    if (splits.empty()) {
      RESIDENT_CHECK_VALUE(rows % size_ == 0, "resident: all_to_all_single: ", what, " dim 0 (",
                           rows, ") is not divisible by the group size ", size_,
                           "; pass split sizes");
    } else {
      RESIDENT_CHECK_VALUE(splits.size() == static_cast<size_t>(size_),
                           "resident: all_to_all_single: ", what, " split sizes have ",
                           splits.size(), " entries for a group of ", size_);
      int64_t sum = 0;
      for (int64_t s : splits) {
        RESIDENT_CHECK_VALUE(s >= 0, "resident: all_to_all_single: negative split size ", s);
        sum += s;
      }
      RESIDENT_CHECK_VALUE(sum == rows, "resident: all_to_all_single: ", what,
                           " split sizes sum to ", sum, " but dim 0 is ", rows);
    }
    size_t off = 0;
    for (int p = 0; p < size_; ++p) {
      const int64_t r = splits.empty() ? rows / size_ : splits[static_cast<size_t>(p)];
      bytes.push_back(static_cast<size_t>(r) * rowBytes(t));
      offs.push_back(off);
      off += bytes.back();
    }
  };
  c10::SmallVector<size_t, 16> in_bytes, in_offs, out_bytes, out_offs;
  layoutOf(input, input_splits, "input", in_bytes, in_offs);
  layoutOf(output, output_splits, "output", out_bytes, out_offs);
  // Only equal splits: with split sizes, each rank's bytes are its own, and ranks could decide
  // differently.
  if (input_splits.empty() && output_splits.empty() &&
      handoff_.takes(HandoffOp::kAllToAllSingle, input, nbytes(input) / static_cast<size_t>(size_)))
    return handOff(HandoffOp::kAllToAllSingle, "resident:all_to_all_single", input,
                   [&](c10d::Backend& b) {
                     return b.alltoall_base(output, input, output_splits, input_splits, opts);
                   });
  c10::SmallVector<const void*, 16> ins;
  c10::SmallVector<void*, 16> outs;
  for (int p = 0; p < size_; ++p) {
    ins.push_back(static_cast<const unsigned char*>(input.data_ptr()) + in_offs[p]);
    outs.push_back(static_cast<unsigned char*>(output.data_ptr()) + out_offs[p]);
  }
  if (input.is_cuda()) {
    return cudaOp(c10d::OpType::ALLTOALL_BASE, "resident:all_to_all_single", {output}, {input},
                  opts.asyncOp, [&](GpuCommunicator& g, void* s) {
                    g.allToAll(ins.data(), in_bytes.data(), outs.data(), out_bytes.data(), s);
                  });
  }
  return cpuAllToAll(c10d::OpType::ALLTOALL_BASE, "resident:all_to_all_single", {output}, {input},
                     ins.data(), in_bytes.data(), outs.data(), out_bytes.data(), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::cpuAllToAll(
    c10d::OpType type, const char* title, c10::ArrayRef<at::Tensor> outputs,
    c10::ArrayRef<at::Tensor> inputs, const void* const* ins, const size_t* in_bytes,
    void* const* outs, const size_t* out_bytes, bool async_op) {
  return cpuOp(type, title, outputs, inputs, async_op, [&](OpList& ops) {
    ops.push_back(comm_->allToAll(ins, in_bytes, outs, out_bytes));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  RESIDENT_CHECK_VALUE(
      outputs.size() == static_cast<size_t>(size_) && inputs.size() == static_cast<size_t>(size_),
      "resident: all_to_all needs ", size_, " input and output tensors, got ", inputs.size(),
      " and ", outputs.size());
  c10::SmallVector<const void*, 16> ins;
  c10::SmallVector<void*, 16> outs;
  c10::SmallVector<size_t, 16> in_bytes, out_bytes;
  for (int p = 0; p < size_; ++p) {
    checkTensor(inputs[p], "all_to_all");
    checkSameKind(inputs[0], inputs[p], "all_to_all", "an input tensor");
    checkSameKind(inputs[0], outputs[p], "all_to_all", "an output tensor");
    ins.push_back(inputs[p].data_ptr());
    outs.push_back(outputs[p].data_ptr());
    in_bytes.push_back(nbytes(inputs[p]));
    out_bytes.push_back(nbytes(outputs[p]));
  }
  if (inputs[0].is_cuda()) {
    return cudaOp(c10d::OpType::ALLTOALL, "resident:all_to_all", outputs, inputs, opts.asyncOp,
                  [&](GpuCommunicator& g, void* s) {
                    g.allToAll(ins.data(), in_bytes.data(), outs.data(), out_bytes.data(), s);
                  });
  }
  return cpuAllToAll(c10d::OpType::ALLTOALL, "resident:all_to_all", outputs, inputs, ins.data(),
                     in_bytes.data(), outs.data(), out_bytes.data(), opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupResident::allToAllDeviceSplits(
    at::Tensor& output, at::Tensor& input, const at::Tensor& send_rows, const at::Tensor& recv_rows,
    bool async_op, bool counts_out) {
  const char* op = "all_to_all_device_splits";
  checkTensor(input, op);
  RESIDENT_CHECK_VALUE(input.is_cuda() || !counts_out, "resident: ", op,
                       ": counts_out needs CUDA tensors (on CPU, exchange the counts first: "
                       "resident_pg.ep.all_to_all_device_splits does)");
  checkSameKind(input, output, op, "the output");
  RESIDENT_CHECK_VALUE(input.dim() >= 2 && input.size(0) == size_, "resident: ", op,
                       ": input must have shape [", size_, " (group size), max_rows, ...], got ",
                       input.sizes());
  RESIDENT_CHECK_VALUE(output.sizes() == input.sizes(), "resident: ", op, ": output has shape ",
                       output.sizes(), " but the input has ", input.sizes());
  for (const at::Tensor* t : {&send_rows, &recv_rows}) {
    const char* what = t == &send_rows ? "send_rows" : "recv_rows";
    RESIDENT_CHECK_VALUE(t->defined(), "resident: ", op, ": ", what, " is undefined");
    RESIDENT_CHECK_VALUE(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong,
                         "resident: ", op, ": ", what, " must be int32 or int64, got ",
                         t->scalar_type());
    RESIDENT_CHECK_VALUE((t->dim() == 1 || (t->dim() == 2 && t->size(1) >= 1)) &&
                             t->size(0) == size_ && t->is_contiguous(),
                         "resident: ", op, ": ", what, " must be a contiguous tensor of shape [",
                         size_, "] (one count per rank) or [", size_,
                         ", n] (n counts per rank, summed), got sizes ", t->sizes());
    RESIDENT_CHECK_VALUE(t->device() == input.device(), "resident: ", op, ": ", what, " is on ",
                         t->device(), " but the input is on ", input.device());
  }
  RESIDENT_CHECK_VALUE(send_rows.scalar_type() == recv_rows.scalar_type(), "resident: ", op,
                       ": send_rows is ", send_rows.scalar_type(), " but recv_rows is ",
                       recv_rows.scalar_type(), " (use one dtype for both)");
  RESIDENT_CHECK_VALUE(send_rows.sizes() == recv_rows.sizes(), "resident: ", op,
                       ": send_rows has shape ", send_rows.sizes(), " but recv_rows has ",
                       recv_rows.sizes(), " (use one shape for both)");
  const size_t per_peer = send_rows.dim() == 2 ? static_cast<size_t>(send_rows.size(1)) : 1;
  const size_t max_rows = static_cast<size_t>(input.size(1));
  const size_t row_bytes =
      max_rows == 0 ? 0 : nbytes(input) / (static_cast<size_t>(size_) * max_rows);
  const size_t cap = max_rows * row_bytes;
  auto* in = static_cast<const unsigned char*>(input.data_ptr());
  auto* out = static_cast<unsigned char*>(output.data_ptr());
  if (input.is_cuda()) {
    const uint32_t count_bytes = static_cast<uint32_t>(send_rows.element_size());
    return cudaOp(c10d::OpType::ALLTOALL_BASE, "resident:all_to_all_device_splits", {output},
                  {input, send_rows, recv_rows}, async_op, [&](GpuCommunicator& g, void* s) {
                    g.allToAllDeviceSplits(in, out, max_rows, row_bytes, send_rows.data_ptr(),
                                           recv_rows.data_ptr(), count_bytes,
                                           static_cast<uint32_t>(per_peer), counts_out, s);
                  });
  }
  // CPU: the counts are host memory, read now (in place, either dtype), as the kernel reads
  // them on the device.
  auto rowsOf = [&](const at::Tensor& t, int p) {
    size_t rows = 0;
    for (size_t i = static_cast<size_t>(p) * per_peer; i < (p + 1) * per_peer; ++i) {
      const int64_t v = t.scalar_type() == at::kLong ? t.data_ptr<int64_t>()[i]
                                                     : int64_t{t.data_ptr<int32_t>()[i]};
      rows += v <= 0 ? size_t{0} : static_cast<size_t>(v);
    }
    return std::min(rows, max_rows);
  };
  c10::SmallVector<const void*, 16> ins;
  c10::SmallVector<void*, 16> outs;
  c10::SmallVector<size_t, 16> in_bytes, out_bytes;
  for (int p = 0; p < size_; ++p) {
    ins.push_back(in + p * cap);
    outs.push_back(out + p * cap);
    in_bytes.push_back(rowsOf(send_rows, p) * row_bytes);
    // This rank's own rows: what it sends itself (as on the device).
    out_bytes.push_back(rowsOf(p == rank_ ? send_rows : recv_rows, p) * row_bytes);
  }
  return cpuAllToAll(c10d::OpType::ALLTOALL_BASE, "resident:all_to_all_device_splits", {output},
                     {input}, ins.data(), in_bytes.data(), outs.data(), out_bytes.data(), async_op);
}

}  // namespace resident
