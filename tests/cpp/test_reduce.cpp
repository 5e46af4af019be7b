// Reductions: rank-order semantics for every dtype and op against straightforward references,
// including half/bfloat16 conversions (round to nearest even) and integer wrap-around.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "check.hpp"
#include "core/reduce.hpp"

using namespace resident;

int main() {
  std::mt19937_64 rng(12345);
  // Half conversion round-trips every finite half exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t v = static_cast<uint16_t>(h);
    if (((v >> 10) & 0x1f) == 0x1f) continue;  // inf/nan
    CHECK(floatToHalf(halfToFloat(v)) == v);
  }
  CHECK(floatToHalf(65520.0f) == 0x7c00);            // rounds to inf
  CHECK(floatToHalf(1.0f + 1.0f / 2048) == 0x3c00);  // tie to even
  CHECK(halfToFloat(0x0001) == std::ldexp(1.0f, -24));
  CHECK(floatToBf16(1.0f) == 0x3f80);
  CHECK(bf16ToFloat(floatToBf16(3.140625f)) == 3.140625f);

  // float32 SUM/AVG/MIN/MAX/PRODUCT over 3 inputs, rank order.
  const int n = 3;
  const size_t count = 1001;
  std::vector<std::vector<float>> f(n, std::vector<float>(count));
  for (auto& v : f)
    for (auto& x : v) x = std::uniform_real_distribution<float>(-2, 2)(rng);
  const void* in[n] = {f[0].data(), f[1].data(), f[2].data()};
  std::vector<float> out(count);
  reduceInto(DType::kFloat32, RedOp::kSum, out.data(), in, n, count);
  for (size_t i = 0; i < count; ++i) CHECK(out[i] == (f[0][i] + f[1][i]) + f[2][i]);
  reduceInto(DType::kFloat32, RedOp::kAvg, out.data(), in, n, count);
  for (size_t i = 0; i < count; ++i) CHECK(out[i] == ((f[0][i] + f[1][i]) + f[2][i]) / 3.0f);
  reduceInto(DType::kFloat32, RedOp::kMax, out.data(), in, n, count);
  for (size_t i = 0; i < count; ++i) CHECK(out[i] == std::max(std::max(f[0][i], f[1][i]), f[2][i]));
  reduceInto(DType::kFloat32, RedOp::kProduct, out.data(), in, n, count);
  for (size_t i = 0; i < count; ++i) CHECK(out[i] == (f[0][i] * f[1][i]) * f[2][i]);

  // In place: output aliases input 0.
  std::vector<float> a = f[0];
  const void* in2[n] = {a.data(), f[1].data(), f[2].data()};
  reduceInto(DType::kFloat32, RedOp::kMin, a.data(), in2, n, count);
  for (size_t i = 0; i < count; ++i) CHECK(a[i] == std::min(std::min(f[0][i], f[1][i]), f[2][i]));

  // uint8 SUM wraps mod 256; AVG uses the unwrapped sum.
  std::vector<std::vector<uint8_t>> u(n, std::vector<uint8_t>(count));
  for (auto& v : u)
    for (auto& x : v) x = static_cast<uint8_t>(rng());
  const void* uin[n] = {u[0].data(), u[1].data(), u[2].data()};
  std::vector<uint8_t> uout(count);
  reduceInto(DType::kUInt8, RedOp::kSum, uout.data(), uin, n, count);
  for (size_t i = 0; i < count; ++i)
    CHECK(uout[i] == static_cast<uint8_t>(u[0][i] + u[1][i] + u[2][i]));
  reduceInto(DType::kUInt8, RedOp::kAvg, uout.data(), uin, n, count);
  for (size_t i = 0; i < count; ++i) CHECK(uout[i] == (u[0][i] + u[1][i] + u[2][i]) / 3);
  reduceInto(DType::kUInt8, RedOp::kBXor, uout.data(), uin, n, count);
  for (size_t i = 0; i < count; ++i) CHECK(uout[i] == (u[0][i] ^ u[1][i] ^ u[2][i]));

  // int8: SUM/PRODUCT wrap mod 256 like uint8, but MIN/MAX order signed values and AVG
  // truncates a signed sum toward zero.
  std::vector<std::vector<int8_t>> s(n, std::vector<int8_t>(count));
  for (auto& v : s)
    for (auto& x : v) x = static_cast<int8_t>(rng());
  const void* sin[n] = {s[0].data(), s[1].data(), s[2].data()};
  std::vector<int8_t> sout(count);
  reduceInto(DType::kInt8, RedOp::kSum, sout.data(), sin, n, count);
  for (size_t i = 0; i < count; ++i)
    CHECK(sout[i] == static_cast<int8_t>(static_cast<uint8_t>(s[0][i] + s[1][i] + s[2][i])));
  reduceInto(DType::kInt8, RedOp::kProduct, sout.data(), sin, n, count);
  for (size_t i = 0; i < count; ++i)
    CHECK(sout[i] == static_cast<int8_t>(static_cast<uint8_t>(s[0][i] * s[1][i] * s[2][i])));
  reduceInto(DType::kInt8, RedOp::kMin, sout.data(), sin, n, count);
  for (size_t i = 0; i < count; ++i)
    CHECK(sout[i] == std::min(std::min(s[0][i], s[1][i]), s[2][i]));
  reduceInto(DType::kInt8, RedOp::kMax, sout.data(), sin, n, count);
  for (size_t i = 0; i < count; ++i)
    CHECK(sout[i] == std::max(std::max(s[0][i], s[1][i]), s[2][i]));
  reduceInto(DType::kInt8, RedOp::kAvg, sout.data(), sin, n, count);
  for (size_t i = 0; i < count; ++i) CHECK(sout[i] == (s[0][i] + s[1][i] + s[2][i]) / 3);
  reduceInto(DType::kInt8, RedOp::kBOr, sout.data(), sin, n, count);
  for (size_t i = 0; i < count; ++i) CHECK(sout[i] == (s[0][i] | s[1][i] | s[2][i]));
  CHECK(reductionSupported(DType::kInt8, RedOp::kBXor));

  // int32 AVG truncates toward zero.
  std::vector<int32_t> i0 = {-7, 7, -1}, i1 = {0, 0, 0}, i2 = {0, 1, -1};
  const void* iin[n] = {i0.data(), i1.data(), i2.data()};
  std::vector<int32_t> iout(3);
  reduceInto(DType::kInt32, RedOp::kAvg, iout.data(), iin, n, 3);
  CHECK(iout[0] == -2 && iout[1] == 2 && iout[2] == 0);

  // bfloat16 accumulates in float32 and rounds once.
  std::vector<uint16_t> b0(count), b1(count), b2(count), bout(count);
  for (size_t i = 0; i < count; ++i) {
    b0[i] = floatToBf16(std::uniform_real_distribution<float>(-1, 1)(rng));
    b1[i] = floatToBf16(std::uniform_real_distribution<float>(-1, 1)(rng));
    b2[i] = floatToBf16(std::uniform_real_distribution<float>(-1, 1)(rng));
  }
  const void* bin[n] = {b0.data(), b1.data(), b2.data()};
  reduceInto(DType::kBFloat16, RedOp::kSum, bout.data(), bin, n, count);
  for (size_t i = 0; i < count; ++i) {
    const float ref = (bf16ToFloat(b0[i]) + bf16ToFloat(b1[i])) + bf16ToFloat(b2[i]);
    CHECK(bout[i] == floatToBf16(ref));
  }
  CHECK(!reductionSupported(DType::kFloat32, RedOp::kBAnd));
  CHECK(reductionSupported(DType::kInt64, RedOp::kBAnd));
  std::puts("test_reduce: ok");
  return 0;
}
