// CPU reductions of the resident backend. Inputs are combined in rank order (0..n-1), so every
// rank computes bitwise the same result. float16/bfloat16 accumulate in float32 and round once;
// integer SUM/AVG accumulate in 64 bits (SUM wraps like the element type); AVG divides the sum
// by n at the end (integers truncate toward zero).
#pragma once

#include <cstddef>

#include "core/dtype.hpp"

namespace resident {

bool reductionSupported(DType dtype, RedOp op);

// out[i] = inputs[0][i] op ... op inputs[n-1][i]. `out` may alias any input.
void reduceInto(DType dtype, RedOp op, void* out, const void* const* inputs, int n, size_t count);

float halfToFloat(uint16_t h);
uint16_t floatToHalf(float f);
float bf16ToFloat(uint16_t b);
uint16_t floatToBf16(float f);

}  // namespace resident
