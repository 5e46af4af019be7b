// What the c10d adapter checks of a call's tensors and options before it starts anything (a
// ValueError that names the op and the problem), how a c10d reduction maps onto the core's
// (dtype, op, values per element), and how core errors become the exceptions torch.distributed
// users expect. Shared by the adapter's files (process_group_resident.cpp,
// process_group_alltoall.cpp, process_group_rooted.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <type_traits>
#include <vector>

#include "c10d/work_cuda.hpp"  // cudaPathBuilt
#include "core/dtype.hpp"
#include "core/error.hpp"

namespace resident {

// Messages are built from strings only: streaming values through c10::str instantiates
// libstdc++ stream code inside this extension, which crashed under torch 2.11 (GPU machine).
inline void append(std::string& s, const char* v) {
  s += v;
}
inline void append(std::string& s, const std::string& v) {
  s += v;
}
template <typename T, std::enable_if_t<std::is_integral<T>::value, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, c10::ScalarType t) {
  s += c10::toString(t);
}
inline void append(std::string& s, const c10::Device& d) {
  s += d.str();
}
inline void append(std::string& s, c10::Layout l) {
  switch (l) {
    case c10::kStrided:
      s += "strided";
      break;
    case c10::kSparse:
      s += "sparse (COO)";
      break;
    case c10::kSparseCsr:
    case c10::kSparseCsc:
    case c10::kSparseBsr:
    case c10::kSparseBsc:
      s += "sparse (compressed)";
      break;
    default:
      s += "non-strided";
  }
}
inline void append(std::string& s, c10::IntArrayRef a) {
  s += "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  s += "]";
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

#define RESIDENT_CHECK_VALUE(cond, ...)                                     \
  do {                                                                      \
    if (!(cond)) C10_THROW_ERROR(ValueError, ::resident::cat(__VA_ARGS__)); \
  } while (0)

// Core errors become the exceptions torch.distributed users expect.
template <typename F>
auto translateErrors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const InvalidArgument& e) {
    C10_THROW_ERROR(ValueError, e.what());
  } catch (const CommError& e) {
    C10_THROW_ERROR(DistBackendError, e.what());
  }
}

inline void checkTensor(const at::Tensor& t, const char* op) {
  RESIDENT_CHECK_VALUE(t.defined(), "resident: ", op, ": undefined tensor");
  RESIDENT_CHECK_VALUE(t.layout() == c10::kStrided, "resident: ", op,
                       ": only dense (strided) tensors are supported, got ", t.layout());
  RESIDENT_CHECK_VALUE(t.is_contiguous(), "resident: ", op,
                       ": tensors must be contiguous (got sizes ", t.sizes(), " strides ",
                       t.strides(), "); call .contiguous() first");
  RESIDENT_CHECK_VALUE(t.device().is_cpu() || (t.device().is_cuda() && cudaPathBuilt()),
                       "resident: ", op, ": tensor on ", t.device(),
                       " is not supported (resident serves CPU tensors",
                       cudaPathBuilt() ? " and CUDA tensors)" : "; this build has no CUDA path)");
}

inline void checkSameKind(const at::Tensor& ref, const at::Tensor& t, const char* op,
                          const char* what) {
  checkTensor(t, op);
  RESIDENT_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), "resident: ", op, ": ", what,
                       " has dtype ", t.scalar_type(), " but the input has ", ref.scalar_type(),
                       " (dtype mix)");
  RESIDENT_CHECK_VALUE(t.device() == ref.device(), "resident: ", op, ": ", what, " is on ",
                       t.device(), " but the input is on ", ref.device(), " (device mix)");
}

inline const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  RESIDENT_CHECK_VALUE(tensors.size() == 1, "resident: ", op, " takes exactly one tensor, got ",
                       tensors.size());
  checkTensor(tensors[0], op);
  return tensors[0];
}

inline DType reductionType(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kDouble:
      return DType::kFloat64;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kInt:
      return DType::kInt32;
    case at::kLong:
      return DType::kInt64;
    case at::kByte:
      return DType::kUInt8;
    default:
      C10_THROW_ERROR(ValueError, cat("resident: ", op, " does not support dtype ", t.scalar_type(),
                                      " (supported: float32, float64, float16, bfloat16, int32, "
                                      "int64, uint8, int8, bool; complex64/128 for SUM and "
                                      "AVG)"));
  }
}

inline std::string reduceOpName(const c10d::ReduceOp& op) {
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM) return "PREMUL_SUM";
  return std::to_string(static_cast<int>(op.op_));
}

inline RedOp reductionOp(const c10d::ReduceOp& op, const char* name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return RedOp::kSum;
    case c10d::ReduceOp::AVG:
      return RedOp::kAvg;
    case c10d::ReduceOp::MIN:
      return RedOp::kMin;
    case c10d::ReduceOp::MAX:
      return RedOp::kMax;
    case c10d::ReduceOp::PRODUCT:
      return RedOp::kProduct;
    case c10d::ReduceOp::BAND:
      return RedOp::kBAnd;
    case c10d::ReduceOp::BOR:
      return RedOp::kBOr;
    case c10d::ReduceOp::BXOR:
      return RedOp::kBXor;
    default:
      C10_THROW_ERROR(ValueError,
                      cat("resident: ", name, " does not support reduce op ", reduceOpName(op),
                          " (supported: SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR)"));
  }
}

inline size_t nbytes(const at::Tensor& t) {
  return t.numel() * t.element_size();
}

// How the core reduces a tensor of a c10d reduction: its element type, op and values per tensor
// element. bool reduces as uint8 with SUM as MAX (a logical or that cannot overflow, as NCCL
// does), complex as its (real, imaginary) float pairs for SUM and AVG (as torch's all_reduce
// does before calling a backend).
struct Reduction {
  DType dtype;
  RedOp op;
  int64_t values_per_element;
  size_t count(const at::Tensor& t) const {
    return static_cast<size_t>(t.numel() * values_per_element);
  }
};

inline Reduction reductionOf(const at::Tensor& t, const c10d::ReduceOp& reduce_op,
                             const char* name) {
  const RedOp op = reductionOp(reduce_op, name);
  switch (t.scalar_type()) {
    case at::kBool:
      RESIDENT_CHECK_VALUE(op != RedOp::kAvg, "resident: ", name,
                           ": AVG is not defined for bool tensors");
      return {DType::kUInt8, op == RedOp::kSum ? RedOp::kMax : op, 1};
    case at::kComplexFloat:
    case at::kComplexDouble:
      RESIDENT_CHECK_VALUE(op == RedOp::kSum || op == RedOp::kAvg, "resident: ", name, ": ",
                           redOpName(op), " is not defined for complex tensors (SUM and AVG are)");
      return {t.scalar_type() == at::kComplexFloat ? DType::kFloat32 : DType::kFloat64, op, 2};
    case at::kChar:
      return {DType::kInt8, op, 1};
    default:
      return {reductionType(t, name), op, 1};
  }
}

}  // namespace resident
