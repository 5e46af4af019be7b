// Torch-free element types and reduction operators.
#pragma once

#include <cstddef>
#include <cstdint>

namespace resident {

enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt32,
  kInt64,
  kUInt8,
  kInt8,
  kBytes,  // opaque payload: data movement only, no reductions
};

enum class RedOp : uint8_t { kSum = 0, kAvg, kMin, kMax, kProduct, kBAnd, kBOr, kBXor, kNone };

inline size_t dtypeSize(DType t) {
  switch (t) {
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kUInt8:
    case DType::kInt8:
    case DType::kBytes:
      return 1;
  }
  return 1;
}

inline bool isIntegral(DType t) {
  return t == DType::kInt32 || t == DType::kInt64 || t == DType::kUInt8 || t == DType::kInt8;
}

// Whether the CUDA kernels reduce this type (kernels/reduce_device.cuh mirrors the codes up to
// kInt8 and would take any later one for uint8).
inline bool deviceReduces(DType t) {
  return static_cast<int>(t) <= static_cast<int>(DType::kInt8);
}

const char* dtypeName(DType t);
const char* redOpName(RedOp op);

}  // namespace resident
