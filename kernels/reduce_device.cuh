// Device reductions over one 8-byte line payload: the lanes of the word are loaded into an
// accumulation type (float for float16/bfloat16, int64 for integers, as the CPU path does),
// folded in rank order and rounded once at the end, so every rank computes bitwise the same.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace resident {
namespace gpu {

// Values of core/dtype.hpp (DType, RedOp): kept in step by a static_assert in the launcher.
enum DTypeCode : uint8_t { kF32 = 0, kF64, kF16, kBF16, kI32, kI64, kU8, kI8 };
enum RedOpCode : uint8_t { kSum = 0, kAvg, kMin, kMax, kProduct, kBAnd, kBOr, kBXor };

template <typename T, typename A>
struct Convert {
  __device__ static A to(T v) { return static_cast<A>(v); }
  __device__ static T from(A v) { return static_cast<T>(v); }
};
struct HalfBits {
  __device__ static float to(uint16_t v) { return __half2float(__ushort_as_half(v)); }
  __device__ static uint16_t from(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
struct BF16Bits {
  __device__ static float to(uint16_t v) { return __bfloat162float(__ushort_as_bfloat16(v)); }
  __device__ static uint16_t from(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};

template <typename A>
__device__ __forceinline__ A combine(uint8_t op, A acc, A v) {
  switch (op) {
    case kSum:
    case kAvg:
      if constexpr (sizeof(A) == 8 && !std::is_floating_point<A>::value)
        return static_cast<A>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(v));
      else
        return acc + v;
    case kProduct:
      if constexpr (sizeof(A) == 8 && !std::is_floating_point<A>::value)
        return static_cast<A>(static_cast<uint64_t>(acc) * static_cast<uint64_t>(v));
      else
        return acc * v;
    case kMin:
      return v < acc ? v : acc;
    case kMax:
      return v > acc ? v : acc;
    default:
      break;
  }
  if constexpr (!std::is_floating_point<A>::value) {
    if (op == kBAnd) return acc & v;
    if (op == kBOr) return acc | v;
    if (op == kBXor) return acc ^ v;
  }
  return acc;
}

// Accumulator of one line: 8 / sizeof(T) lanes.
template <typename T, typename A, typename Cvt>
struct LineAcc {
  static constexpr int kLanes = 8 / sizeof(T);
  A lane[kLanes];

  __device__ static void split(uint64_t w, T (&v)[kLanes]) {
#pragma unroll
    for (int i = 0; i < kLanes; ++i) {
      uint64_t bits = (w >> (8 * sizeof(T) * i));
      if constexpr (sizeof(T) < 8) bits &= (1ull << (8 * sizeof(T))) - 1;
      T x;
      memcpy(&x, &bits, sizeof(T));
      v[i] = x;
    }
  }
  __device__ void first(uint64_t w) {
    T v[kLanes];
    split(w, v);
#pragma unroll
    for (int i = 0; i < kLanes; ++i) lane[i] = Cvt::to(v[i]);
  }
  __device__ void fold(uint8_t op, uint64_t w) {
    T v[kLanes];
    split(w, v);
#pragma unroll
    for (int i = 0; i < kLanes; ++i) lane[i] = combine<A>(op, lane[i], Cvt::to(v[i]));
  }
  __device__ uint64_t result(uint8_t op, int nranks) const {
    uint64_t w = 0;
#pragma unroll
    for (int i = 0; i < kLanes; ++i) {
      A a = lane[i];
      if (op == kAvg) a = a / static_cast<A>(nranks);
      const T x = Cvt::from(a);
      uint64_t bits = 0;
      memcpy(&bits, &x, sizeof(T));
      w |= bits << (8 * sizeof(T) * i);
    }
    return w;
  }
};

using AccF32 = LineAcc<float, float, Convert<float, float>>;
using AccF64 = LineAcc<double, double, Convert<double, double>>;
using AccF16 = LineAcc<uint16_t, float, HalfBits>;
using AccBF16 = LineAcc<uint16_t, float, BF16Bits>;
using AccI32 = LineAcc<int32_t, int64_t, Convert<int32_t, int64_t>>;
using AccI64 = LineAcc<int64_t, int64_t, Convert<int64_t, int64_t>>;
using AccU8 = LineAcc<uint8_t, int64_t, Convert<uint8_t, int64_t>>;
using AccI8 = LineAcc<int8_t, int64_t, Convert<int8_t, int64_t>>;

// Calls f(Acc{}) with the accumulator of DTypeCode `dtype` (kU8 for any other code): on the
// device to run a reduction, on the host to pick a kernel's instantiation.
#pragma nv_exec_check_disable
template <typename F>
__host__ __device__ inline auto withAcc(uint8_t dtype, F&& f) {
  switch (dtype) {
    case kF32:
      return f(AccF32{});
    case kF64:
      return f(AccF64{});
    case kF16:
      return f(AccF16{});
    case kBF16:
      return f(AccBF16{});
    case kI32:
      return f(AccI32{});
    case kI64:
      return f(AccI64{});
    case kI8:
      return f(AccI8{});
    default:
      return f(AccU8{});
  }
}

}  // namespace gpu
}  // namespace resident
