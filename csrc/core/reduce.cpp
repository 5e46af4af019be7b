#include "core/reduce.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace resident {

float halfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {                                               // subnormal half (or zero)
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // from float mantissa units to half subnormal units
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t result = mant >> shift;
    if (rem > halfway || (rem == halfway && (result & 1u))) ++result;
    return static_cast<uint16_t>(sign | result);
  }
  uint32_t result = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

float bf16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // nan
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

namespace {

// Element access: load to the accumulation type, store from it.
template <typename T>
struct Plain {
  using Acc = T;
  static Acc load(const void* p, size_t i) { return static_cast<const T*>(p)[i]; }
  static void store(void* p, size_t i, Acc v) { static_cast<T*>(p)[i] = v; }
};
struct Half {
  using Acc = float;
  static Acc load(const void* p, size_t i) {
    return halfToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  static void store(void* p, size_t i, Acc v) { static_cast<uint16_t*>(p)[i] = floatToHalf(v); }
};
struct BFloat {
  using Acc = float;
  static Acc load(const void* p, size_t i) {
    return bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  static void store(void* p, size_t i, Acc v) { static_cast<uint16_t*>(p)[i] = floatToBf16(v); }
};
// Integers accumulate in uint64 (wrapping arithmetic is well defined there) and are
// reinterpreted as signed where the order matters.
template <typename T>
struct Int {
  using Acc = int64_t;
  static Acc load(const void* p, size_t i) { return static_cast<Acc>(static_cast<const T*>(p)[i]); }
  static void store(void* p, size_t i, Acc v) { static_cast<T*>(p)[i] = static_cast<T>(v); }
};

template <typename A>
inline A wrapAdd(A a, A b) {
  if constexpr (std::is_integral<A>::value) {
    return static_cast<A>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
  } else {
    return a + b;
  }
}
template <typename A>
inline A wrapMul(A a, A b) {
  if constexpr (std::is_integral<A>::value) {
    return static_cast<A>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
  } else {
    return a * b;
  }
}

template <typename E, RedOp Op>
void reduceTyped(void* out, const void* const* in, int n, size_t count) {
  using A = typename E::Acc;
  for (size_t i = 0; i < count; ++i) {
    A acc = E::load(in[0], i);
    for (int r = 1; r < n; ++r) {
      const A v = E::load(in[r], i);
      if constexpr (Op == RedOp::kSum || Op == RedOp::kAvg)
        acc = wrapAdd(acc, v);
      else if constexpr (Op == RedOp::kProduct)
        acc = wrapMul(acc, v);
      else if constexpr (Op == RedOp::kMin)
        acc = v < acc ? v : acc;
      else if constexpr (Op == RedOp::kMax)
        acc = v > acc ? v : acc;
      else if constexpr (Op == RedOp::kBAnd)
        acc = acc & v;
      else if constexpr (Op == RedOp::kBOr)
        acc = acc | v;
      else if constexpr (Op == RedOp::kBXor)
        acc = acc ^ v;
    }
    if constexpr (Op == RedOp::kAvg) acc = acc / static_cast<A>(n);
    E::store(out, i, acc);
  }
}

template <typename E>
void dispatchFloatOp(RedOp op, void* out, const void* const* in, int n, size_t count) {
  switch (op) {
    case RedOp::kSum:
      return reduceTyped<E, RedOp::kSum>(out, in, n, count);
    case RedOp::kAvg:
      return reduceTyped<E, RedOp::kAvg>(out, in, n, count);
    case RedOp::kMin:
      return reduceTyped<E, RedOp::kMin>(out, in, n, count);
    case RedOp::kMax:
      return reduceTyped<E, RedOp::kMax>(out, in, n, count);
    case RedOp::kProduct:
      return reduceTyped<E, RedOp::kProduct>(out, in, n, count);
    default:
      return;
  }
}

template <typename E>
void dispatchIntOp(RedOp op, void* out, const void* const* in, int n, size_t count) {
  switch (op) {
    case RedOp::kBAnd:
      return reduceTyped<E, RedOp::kBAnd>(out, in, n, count);
    case RedOp::kBOr:
      return reduceTyped<E, RedOp::kBOr>(out, in, n, count);
    case RedOp::kBXor:
      return reduceTyped<E, RedOp::kBXor>(out, in, n, count);
    default:
      return dispatchFloatOp<E>(op, out, in, n, count);
  }
}

}  // namespace

bool reductionSupported(DType dtype, RedOp op) {
  if (dtype == DType::kBytes || op == RedOp::kNone) return false;
  if (op == RedOp::kBAnd || op == RedOp::kBOr || op == RedOp::kBXor) return isIntegral(dtype);
  return true;
}

void reduceInto(DType dtype, RedOp op, void* out, const void* const* inputs, int n, size_t count) {
  switch (dtype) {
    case DType::kFloat32:
      return dispatchFloatOp<Plain<float>>(op, out, inputs, n, count);
    case DType::kFloat64:
      return dispatchFloatOp<Plain<double>>(op, out, inputs, n, count);
    case DType::kFloat16:
      return dispatchFloatOp<Half>(op, out, inputs, n, count);
    case DType::kBFloat16:
      return dispatchFloatOp<BFloat>(op, out, inputs, n, count);
    case DType::kInt32:
      return dispatchIntOp<Int<int32_t>>(op, out, inputs, n, count);
    case DType::kInt64:
      return dispatchIntOp<Int<int64_t>>(op, out, inputs, n, count);
    case DType::kUInt8:
      return dispatchIntOp<Int<uint8_t>>(op, out, inputs, n, count);
    case DType::kInt8:
      return dispatchIntOp<Int<int8_t>>(op, out, inputs, n, count);
    case DType::kBytes:
      return;
  }
}

const char* dtypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt8:
      return "int8";
    case DType::kBytes:
      return "bytes";
  }
  return "?";
}

const char* redOpName(RedOp op) {
  switch (op) {
    case RedOp::kSum:
      return "SUM";
    case RedOp::kAvg:
      return "AVG";
    case RedOp::kMin:
      return "MIN";
    case RedOp::kMax:
      return "MAX";
    case RedOp::kProduct:
      return "PRODUCT";
    case RedOp::kBAnd:
      return "BAND";
    case RedOp::kBOr:
      return "BOR";
    case RedOp::kBXor:
      return "BXOR";
    case RedOp::kNone:
      return "none";
  }
  return "?";
}

}  // namespace resident
