// resident_pg._C's EP kernel entry points: plain ints and addresses in, one launch out.
#include "c10d/ep_bindings.hpp"

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ep_args.hpp"

namespace py = pybind11;

namespace resident {
namespace {

// A tensor's address, as Python hands it over (Tensor.data_ptr()).
template <typename T>
T* at(uintptr_t address) {
  return reinterpret_cast<T*>(address);  // NOLINT(performance-no-int-to-ptr)
}

void check(const char* kernel, const std::string& error) {
  if (!error.empty()) throw std::runtime_error(std::string("resident ep ") + kernel + ": " + error);
}

ep::Dtype dtypeOf(int code) {
  if (code < 0 || code > static_cast<int>(ep::Dtype::kBFloat16))
    throw std::invalid_argument("resident ep: dtype code " + std::to_string(code) +
                                " is not float32 (0), float16 (1) or bfloat16 (2)");
  return static_cast<ep::Dtype>(code);
}

// The route kernel's row cast, checked against the row geometry it writes.
ep::RowCast castOf(int code, int64_t hidden, int64_t row_bytes) {
  if (code == static_cast<int>(ep::RowCast::kCopy)) return ep::RowCast::kCopy;
  if (code != static_cast<int>(ep::RowCast::kFp8) &&
      code != static_cast<int>(ep::RowCast::kFp8Ue8m0))
    throw std::invalid_argument("resident ep: route cast " + std::to_string(code) +
                                " is not copy (0), fp8 (1) or fp8 with UE8M0 scales (2)");
  const bool ue8m0 = code == static_cast<int>(ep::RowCast::kFp8Ue8m0);
  const int64_t align = ue8m0 ? 512 : 128;  // UE8M0 scales are read as int32s of 4
  const int64_t want = hidden + hidden / 128 * (ue8m0 ? 1 : 4);
  if (hidden < align || hidden % align != 0 || row_bytes != want)
    throw std::invalid_argument("resident ep: an FP8 route needs hidden a multiple of " +
                                std::to_string(align) + " and rows of " + std::to_string(want) +
                                " bytes; got hidden " + std::to_string(hidden) + ", rows of " +
                                std::to_string(row_bytes));
  return static_cast<ep::RowCast>(code);
}

}  // namespace

void bindEpKernels(py::module_& m) {
  m.def("ep_kernels_built", &ep::kernelsBuilt,
        "True when this build has the EP dispatch/combine kernels (built with nvcc).");
  m.def(
      "ep_route",
      [](uintptr_t topk_idx, int index_bytes, int tokens, int topk, int experts, int ranks,
         int64_t slots, uintptr_t x, int64_t x_stride, uintptr_t send_x, int64_t row_bytes,
         uintptr_t send_counts, uintptr_t pair_slot, uintptr_t dropped, uintptr_t stream, int cast,
         int x_dtype, bool round_scale, int64_t hidden) {
        ep::RouteArgs a{};
        a.cast = castOf(cast, hidden, row_bytes);
        a.x_dtype = dtypeOf(x_dtype);
        a.round_scale = round_scale || a.cast == ep::RowCast::kFp8Ue8m0 ? 1 : 0;
        a.hidden = hidden;
        a.topk_idx = at<const void>(topk_idx);
        a.index_bytes = index_bytes;
        a.tokens = tokens;
        a.topk = topk;
        a.experts = experts;
        a.ranks = ranks;
        a.slots = slots;
        a.x = at<const void>(x);
        a.x_stride = x_stride;
        a.send_x = at<void>(send_x);
        a.row_bytes = row_bytes;
        a.send_counts = at<int64_t>(send_counts);
        a.pair_slot = at<int64_t>(pair_slot);
        a.dropped = at<int64_t>(dropped);
        check("route", ep::launchRoute(a, at<void>(stream)));
      },
      "Dispatch's routing and packing kernel (kernels/ep_args.hpp, RouteArgs); addresses as "
      "ints; cast 0 copies rows, 1 / 2 casts activations of x_dtype to FP8 rows (float32 / "
      "UE8M0 scales).",
      py::arg("topk_idx"), py::arg("index_bytes"), py::arg("tokens"), py::arg("topk"),
      py::arg("experts"), py::arg("ranks"), py::arg("slots"), py::arg("x"), py::arg("x_stride"),
      py::arg("send_x"), py::arg("row_bytes"), py::arg("send_counts"), py::arg("pair_slot"),
      py::arg("dropped"), py::arg("stream"), py::arg("cast") = 0, py::arg("x_dtype") = 0,
      py::arg("round_scale") = false, py::arg("hidden") = 0);
  m.def(
      "ep_unpack",
      [](uintptr_t recv_counts, int ranks, int local_experts, int64_t slots, int64_t max_slots,
         uintptr_t recv_x, uintptr_t expert_x, int64_t row_bytes, int64_t head_bytes,
         uintptr_t tail_out, uintptr_t expert_counts, uintptr_t zero_from, uintptr_t back_index,
         uintptr_t stream) {
        const bool split = tail_out != 0;
        if (head_bytes < 1 || head_bytes > row_bytes || (split != (head_bytes < row_bytes)) ||
            (split && (head_bytes % 4 != 0 || row_bytes % 4 != 0)))
          throw std::invalid_argument(
              "resident ep unpack: head_bytes " + std::to_string(head_bytes) + " of rows of " +
              std::to_string(row_bytes) +
              " bytes: a split row needs tail_out and a head and tail of whole 4-byte words");
        ep::UnpackArgs a{};
        a.recv_counts = at<const int64_t>(recv_counts);
        a.ranks = ranks;
        a.local_experts = local_experts;
        a.slots = slots;
        a.max_slots = max_slots;
        a.recv_x = at<const void>(recv_x);
        a.expert_x = at<void>(expert_x);
        a.row_bytes = row_bytes;
        a.head_bytes = head_bytes;
        a.tail_out = at<int32_t>(tail_out);
        a.expert_counts = at<int32_t>(expert_counts);
        a.zero_from = at<int32_t>(zero_from);
        a.back_index = at<int64_t>(back_index);
        check("unpack", ep::launchUnpack(a, at<void>(stream)));
      },
      "Dispatch's receive-side kernel (UnpackArgs).");
  m.def(
      "ep_combine_pack",
      [](uintptr_t filled, int ranks, int per_source, int64_t slots, uintptr_t back_index,
         uintptr_t expert_y, uintptr_t comb_send, int64_t row_bytes, uintptr_t stream) {
        if (per_source < 1) throw py::value_error("ep_combine_pack: per_source must be >= 1");
        ep::CombinePackArgs a{};
        a.filled = at<const int64_t>(filled);
        a.ranks = ranks;
        a.per_source = per_source;
        a.slots = slots;
        a.back_index = at<const int64_t>(back_index);
        a.expert_y = at<const void>(expert_y);
        a.comb_send = at<void>(comb_send);
        a.row_bytes = row_bytes;
        check("combine pack", ep::launchCombinePack(a, at<void>(stream)));
      },
      "Combine's packing kernel (CombinePackArgs).");
  m.def(
      "ep_combine_reduce",
      [](uintptr_t comb_recv, uintptr_t pair_slot, uintptr_t weights, uintptr_t out, int tokens,
         int topk, int64_t hidden, int64_t no_slot, int in_dtype, int out_dtype, uintptr_t stream) {
        ep::CombineReduceArgs a{};
        a.comb_recv = at<const void>(comb_recv);
        a.pair_slot = at<const int64_t>(pair_slot);
        a.weights = at<const float>(weights);
        a.out = at<void>(out);
        a.tokens = tokens;
        a.topk = topk;
        a.hidden = hidden;
        a.no_slot = no_slot;
        a.in_dtype = dtypeOf(in_dtype);
        a.out_dtype = dtypeOf(out_dtype);
        check("combine reduce", ep::launchCombineReduce(a, at<void>(stream)));
      },
      "Combine's weighted float32 reduction kernel (CombineReduceArgs).");
}

}  // namespace resident
