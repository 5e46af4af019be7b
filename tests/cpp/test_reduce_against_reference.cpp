// The blocked, vectorised reduction and its branch-free conversions against per-element
// references written the plain way: float16 and bfloat16 conversions bitwise over every half and
// a dense sample of floats (every float whose half is subnormal), and reduceInto for every dtype,
// op, rank count, size around the block boundaries and aliasing of the output, on random bit
// patterns (NaN, inf and subnormal floats included).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"
#include "core/reduce.hpp"

using namespace resident;

namespace {

uint32_t bitsOf(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float floatOf(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

float refHalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return floatOf(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return floatOf(sign | ((exp + 127 - 15) << 23) | (mant << 13));
  if (mant == 0) return floatOf(sign);
  exp = 127 - 15 + 1;  // subnormal: normalise
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --exp;
  }
  return floatOf(sign | (exp << 23) | ((mant & 0x3ffu) << 13));
}

uint16_t refFloatToHalf(float f) {
  const uint32_t x = bitsOf(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {                                               // subnormal half or zero
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t shift = 126 - (abs >> 23);
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t result = mant >> shift;
    if (rem > halfway || (rem == halfway && (result & 1u))) ++result;
    return static_cast<uint16_t>(sign | result);
  }
  uint32_t result = (abs - 0x38000000u) >> 13;
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

uint16_t refFloatToBf16(float f) {
  const uint32_t x = bitsOf(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  const uint32_t lower = x & 0xffffu;
  uint32_t upper = x >> 16;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) ++upper;
  return static_cast<uint16_t>(upper);
}

void checkConversions() {
  for (uint32_t h = 0; h < 0x10000; ++h)
    CHECK(bitsOf(halfToFloat(static_cast<uint16_t>(h))) ==
          bitsOf(refHalfToFloat(static_cast<uint16_t>(h))));
  // Every float whose half is subnormal or the smallest normals, both signs; then a sample.
  for (uint32_t abs = 0x32800000u; abs < 0x39000000u; ++abs) {
    CHECK(floatToHalf(floatOf(abs)) == refFloatToHalf(floatOf(abs)));
    CHECK(floatToHalf(floatOf(abs | 0x80000000u)) == refFloatToHalf(floatOf(abs | 0x80000000u)));
  }
  for (uint64_t x = 0; x <= 0xffffffffull; x += 97) {
    const float f = floatOf(static_cast<uint32_t>(x));
    CHECK(floatToHalf(f) == refFloatToHalf(f));
    CHECK(floatToBf16(f) == refFloatToBf16(f));
  }
  for (uint32_t abs = 0x477fe000u; abs < 0x47801000u; ++abs)  // around the overflow to inf
    CHECK(floatToHalf(floatOf(abs)) == refFloatToHalf(floatOf(abs)));
  for (uint32_t abs = 0x7f7ff000u; abs <= 0x7fffffffu && abs >= 0x7f7ff000u; abs += 0x1001u)
    CHECK(floatToBf16(floatOf(abs)) == refFloatToBf16(floatOf(abs)));
}

// Element types as the reference sees them.
template <typename T>
struct PlainRef {
  using Acc = T;
  static Acc load(const void* p, size_t i) { return static_cast<const T*>(p)[i]; }
  static void store(void* p, size_t i, Acc v) { static_cast<T*>(p)[i] = v; }
};
struct HalfRef {
  using Acc = float;
  static Acc load(const void* p, size_t i) {
    return refHalfToFloat(static_cast<const uint16_t*>(p)[i]);
  }
  static void store(void* p, size_t i, Acc v) { static_cast<uint16_t*>(p)[i] = refFloatToHalf(v); }
};
struct BFloatRef {
  using Acc = float;
  static Acc load(const void* p, size_t i) {
    return floatOf(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  }
  static void store(void* p, size_t i, Acc v) { static_cast<uint16_t*>(p)[i] = refFloatToBf16(v); }
};
template <typename T>
struct IntRef {  // 64-bit accumulation, truncated to the element type
  using Acc = int64_t;
  static Acc load(const void* p, size_t i) { return static_cast<const T*>(p)[i]; }
  static void store(void* p, size_t i, Acc v) { static_cast<T*>(p)[i] = static_cast<T>(v); }
};

template <typename E>
void refReduce(RedOp op, void* out, const void* const* in, int n, size_t count) {
  using A = typename E::Acc;
  for (size_t i = 0; i < count; ++i) {
    A acc = E::load(in[0], i);
    for (int r = 1; r < n; ++r) {
      const A v = E::load(in[r], i);
      if constexpr (std::is_integral<A>::value) {
        const uint64_t a = static_cast<uint64_t>(acc), b = static_cast<uint64_t>(v);
        if (op == RedOp::kSum || op == RedOp::kAvg) acc = static_cast<A>(a + b);
        if (op == RedOp::kProduct) acc = static_cast<A>(a * b);
        if (op == RedOp::kBAnd) acc = acc & v;
        if (op == RedOp::kBOr) acc = acc | v;
        if (op == RedOp::kBXor) acc = acc ^ v;
      } else {
        if (op == RedOp::kSum || op == RedOp::kAvg) acc = acc + v;
        if (op == RedOp::kProduct) acc = acc * v;
      }
      if (op == RedOp::kMin) acc = v < acc ? v : acc;
      if (op == RedOp::kMax) acc = v > acc ? v : acc;
    }
    if (op == RedOp::kAvg) acc = acc / static_cast<A>(n);
    E::store(out, i, acc);
  }
}

void refReduceInto(DType t, RedOp op, void* out, const void* const* in, int n, size_t count) {
  switch (t) {
    case DType::kFloat32:
      return refReduce<PlainRef<float>>(op, out, in, n, count);
    case DType::kFloat64:
      return refReduce<PlainRef<double>>(op, out, in, n, count);
    case DType::kFloat16:
      return refReduce<HalfRef>(op, out, in, n, count);
    case DType::kBFloat16:
      return refReduce<BFloatRef>(op, out, in, n, count);
    case DType::kInt32:
      return refReduce<IntRef<int32_t>>(op, out, in, n, count);
    case DType::kInt64:
      return refReduce<IntRef<int64_t>>(op, out, in, n, count);
    case DType::kUInt8:
      return refReduce<IntRef<uint8_t>>(op, out, in, n, count);
    case DType::kInt8:
      return refReduce<IntRef<int8_t>>(op, out, in, n, count);
    case DType::kBytes:
      return;
  }
}

bool isNan(DType t, const unsigned char* p) {
  switch (t) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return std::isnan(f);
    }
    case DType::kFloat64: {
      double d;
      std::memcpy(&d, p, 8);
      return std::isnan(d);
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return (h & 0x7fffu) > 0x7c00u;
    }
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return (h & 0x7fffu) > 0x7f80u;
    }
    default:
      return false;
  }
}

// Equal bitwise, except that which NaN a NaN operand yields is the compiler's choice (it may
// swap the operands of a commutative operation): any NaN matches any NaN.
bool sameResult(DType t, const unsigned char* a, const unsigned char* b) {
  const size_t s = dtypeSize(t);
  if (std::memcmp(a, b, s) == 0) return true;
  return isNan(t, a) && isNan(t, b);
}

void checkReductions() {
  std::mt19937_64 rng(20261205);
  const DType types[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                         DType::kInt32,   DType::kInt64,   DType::kUInt8,   DType::kInt8};
  const RedOp ops[] = {RedOp::kSum,     RedOp::kAvg,  RedOp::kMin, RedOp::kMax,
                       RedOp::kProduct, RedOp::kBAnd, RedOp::kBOr, RedOp::kBXor};
  const size_t counts[] = {0, 1, 5, 255, 256, 257, 511, 512, 513, 1000, 2049};
  int cases = 0;
  for (DType t : types) {
    const size_t es = dtypeSize(t);
    for (RedOp op : ops) {
      if (!reductionSupported(t, op)) continue;
      for (int n : {1, 2, 3, 4, 7}) {
        for (size_t count : counts) {
          std::vector<std::vector<unsigned char>> in(static_cast<size_t>(n),
                                                     std::vector<unsigned char>(count * es + 1));
          const bool values = (rng() & 3) != 0;  // else raw bit patterns: NaN, inf, subnormals
          for (auto& v : in) {
            for (size_t i = 0; i < count; ++i) {
              unsigned char* d = v.data() + i * es;
              const float f = std::uniform_real_distribution<float>(-4, 4)(rng);
              if (values && t == DType::kFloat32)
                std::memcpy(d, &f, 4);
              else if (values && t == DType::kFloat64) {
                const double x = f;
                std::memcpy(d, &x, 8);
              } else if (values && t == DType::kFloat16) {
                const uint16_t h = refFloatToHalf(f);
                std::memcpy(d, &h, 2);
              } else if (values && t == DType::kBFloat16) {
                const uint16_t h = refFloatToBf16(f);
                std::memcpy(d, &h, 2);
              } else
                for (size_t b = 0; b < es; ++b) d[b] = static_cast<unsigned char>(rng());
            }
          }
          std::vector<const void*> ptrs(static_cast<size_t>(n));
          for (int r = 0; r < n; ++r)
            ptrs[static_cast<size_t>(r)] = in[static_cast<size_t>(r)].data();
          std::vector<unsigned char> want(count * es + 1);
          refReduceInto(t, op, want.data(), ptrs.data(), n, count);
          // Out of place, then in place over the first and over the last input.
          for (int alias = -1; alias < 2; ++alias) {
            std::vector<std::vector<unsigned char>> copy = in;
            std::vector<const void*> cp(static_cast<size_t>(n));
            for (int r = 0; r < n; ++r)
              cp[static_cast<size_t>(r)] = copy[static_cast<size_t>(r)].data();
            std::vector<unsigned char> separate(count * es + 1, 0xa5);
            unsigned char* out = alias < 0
                                     ? separate.data()
                                     : copy[alias == 0 ? 0 : static_cast<size_t>(n - 1)].data();
            const unsigned char guard = out[count * es];
            reduceInto(t, op, out, cp.data(), n, count);
            CHECK(out[count * es] == guard);  // nothing written past the end
            for (size_t i = 0; i < count; ++i) {
              if (!sameResult(t, out + i * es, want.data() + i * es)) {
                std::fprintf(stderr, "%s %s n=%d count=%zu alias=%d: element %zu differs\n",
                             dtypeName(t), redOpName(op), n, count, alias, i);
                CHECK(false);
              }
            }
            ++cases;
          }
        }
      }
    }
  }
  CHECK(cases > 1000);
}

}  // namespace

int main() {
  checkConversions();
  checkReductions();
  std::puts("test_reduce_against_reference: ok");
  return 0;
}
