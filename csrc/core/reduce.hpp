// CPU reductions of the resident backend. Inputs are combined in rank order (0..n-1), so every
// rank computes bitwise the same result. float16/bfloat16 accumulate in float32 and round once;
// integer SUM and PRODUCT wrap like the element type; AVG divides the sum by n at the end
// (integers: the 64-bit sum, truncated toward zero).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/dtype.hpp"

namespace resident {

bool reductionSupported(DType dtype, RedOp op);

// out[i] = inputs[0][i] op ... op inputs[n-1][i]. `out` may alias any input.
void reduceInto(DType dtype, RedOp op, void* out, const void* const* inputs, int n, size_t count);

template <typename To, typename From>
inline To bitCast(From v) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To t;
  std::memcpy(&t, &v, sizeof(t));
  return t;
}

// a where take_a, else b, by a mask: the compiler does not turn a floating-point operation
// computed for one case only into a select, so the cases are chosen on bits.
inline uint32_t selectBits(bool take_a, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(take_a);
  return (a & mask) | (b & ~mask);
}

// Conversions, exact to IEEE 754 (round to nearest even; a NaN stays a quiet NaN of its sign).
// Branch-free, so that the reduction loops vectorise.
inline float halfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  // A subnormal half is mant * 2^-24: a normal float, exact, whatever the denormal mode.
  const uint32_t sub_bits =
      bitCast<uint32_t>(static_cast<float>(static_cast<int32_t>(mant)) * 0x1p-24f);
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
  const uint32_t special = 0x7f800000u | (mant << 13);  // inf, nan (payload kept)
  return bitCast<float>(sign |
                        selectBits(exp == 0, sub_bits, selectBits(exp == 0x1fu, special, normal)));
}

inline uint16_t floatToHalf(float f) {
  const uint32_t x = bitCast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  // Below 2^31: signed compares, which SSE2 has.
  const int32_t abs = static_cast<int32_t>(x & 0x7fffffffu);
  // Normal halves: drop 13 mantissa bits, rounding to even; the carry may reach the exponent,
  // and anything from 65520 up becomes inf.
  const int32_t rounded = (abs - 0x38000000 + 0xfff + ((abs >> 13) & 1)) >> 13;
  const int32_t normal = rounded < 0x7c00 ? rounded : 0x7c00;
  // Subnormal halves (and zero): adding 0.5 leaves the float's last place at 2^-24, the
  // half's, so the add (in the default rounding mode) rounds to even as the half must.
  const int32_t shifted = bitCast<int32_t>(bitCast<float>(abs) + 0.5f);
  const uint32_t sub = static_cast<uint32_t>(shifted - 0x3f000000);
  const uint32_t special = abs > 0x7f800000 ? 0x7e00u : 0x7c00u;  // nan, inf
  const uint32_t r = selectBits(abs >= 0x7f800000, special,
                                selectBits(abs < 0x38800000, sub, static_cast<uint32_t>(normal)));
  return static_cast<uint16_t>(sign | r);
}

inline float bf16ToFloat(uint16_t b) {
  return bitCast<float>(static_cast<uint32_t>(b) << 16);
}

inline uint16_t floatToBf16(float f) {
  const uint32_t x = bitCast<uint32_t>(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t nan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

}  // namespace resident
