#include "core/reduce.hpp"

#include <cstdint>
#include <type_traits>

namespace resident {

namespace {

// Elements go through the reduction in blocks: each input's block is folded into float32 (or the
// element type's) accumulators in rank order, then stored once. A full block's loops have a
// constant trip count, so the compiler vectorises them at -O2, conversions of float16 and
// bfloat16 included (branch-free in reduce.hpp); the last, partial block runs the same code.
constexpr size_t kBlock = 256;

// Element access: load to the accumulation type, store from it.
template <typename T>
struct Plain {
  template <typename A>
  static A load(const void* p, size_t i) {
    return static_cast<const T*>(p)[i];
  }
  template <typename A>
  static void store(void* p, size_t i, A v) {
    static_cast<T*>(p)[i] = v;
  }
};
struct Half {
  template <typename A>
  static A load(const void* p, size_t i) {
    return halfToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  template <typename A>
  static void store(void* p, size_t i, A v) {
    static_cast<uint16_t*>(p)[i] = floatToHalf(v);
  }
};
struct BFloat {
  template <typename A>
  static A load(const void* p, size_t i) {
    return bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  template <typename A>
  static void store(void* p, size_t i, A v) {
    static_cast<uint16_t*>(p)[i] = floatToBf16(v);
  }
};
template <typename T>
struct Int {
  template <typename A>
  static A load(const void* p, size_t i) {
    return static_cast<A>(static_cast<const T*>(p)[i]);
  }
  template <typename A>
  static void store(void* p, size_t i, A v) {
    static_cast<T*>(p)[i] = static_cast<T>(v);
  }
};

// The accumulation type. Integers accumulate in their own width, wrapping (what 64-bit
// accumulation truncated to the element type gives for every op but AVG); AVG divides a 64-bit
// sum.
template <typename E, RedOp Op>
struct AccOf {
  using type = float;
};
template <typename T, RedOp Op>
struct AccOf<Plain<T>, Op> {
  using type = T;
};
template <typename T, RedOp Op>
struct AccOf<Int<T>, Op> {
  using type = std::conditional_t<Op == RedOp::kAvg, int64_t, T>;
};

template <typename A>
inline A wrapAdd(A a, A b) {
  if constexpr (std::is_integral<A>::value) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <typename A>
inline A wrapMul(A a, A b) {
  if constexpr (std::is_integral<A>::value) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

template <RedOp Op, typename A>
inline A combine(A acc, A v) {
  if constexpr (Op == RedOp::kSum || Op == RedOp::kAvg)
    return wrapAdd(acc, v);
  else if constexpr (Op == RedOp::kProduct)
    return wrapMul(acc, v);
  else if constexpr (Op == RedOp::kMin)
    return v < acc ? v : acc;
  else if constexpr (Op == RedOp::kMax)
    return v > acc ? v : acc;
  else if constexpr (Op == RedOp::kBAnd)
    return acc & v;
  else if constexpr (Op == RedOp::kBOr)
    return acc | v;
  else
    return acc ^ v;
}

// Elements [base, base + m) of every input folded in rank order into `out`. Inlined with m =
// kBlock, the loops' trip count is a constant.
template <typename E, RedOp Op, typename A>
__attribute__((always_inline)) inline void reduceBlock(void* out, const void* const* in, int n,
                                                       size_t base, size_t m, A* acc) {
  const void* first = in[0];
  for (size_t j = 0; j < m; ++j) acc[j] = E::template load<A>(first, base + j);
  for (int r = 1; r < n; ++r) {
    const void* p = in[r];
    for (size_t j = 0; j < m; ++j) acc[j] = combine<Op>(acc[j], E::template load<A>(p, base + j));
  }
  if constexpr (Op == RedOp::kAvg) {
    const A div = static_cast<A>(n);
    for (size_t j = 0; j < m; ++j) acc[j] = acc[j] / div;
  }
  for (size_t j = 0; j < m; ++j) E::store(out, base + j, acc[j]);
}

template <typename E, RedOp Op>
void reduceTyped(void* out, const void* const* in, int n, size_t count) {
  using A = typename AccOf<E, Op>::type;
  // Every block reads all inputs before it writes `out`, which may alias any of them.
  alignas(64) A acc[kBlock];
  size_t base = 0;
  for (; base + kBlock <= count; base += kBlock) reduceBlock<E, Op>(out, in, n, base, kBlock, acc);
  if (base < count) reduceBlock<E, Op>(out, in, n, base, count - base, acc);
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
