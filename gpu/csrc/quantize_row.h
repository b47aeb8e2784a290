// One activation row quantized to int8 with its own scale, as oneDNN's u8 x s8 kernels take it:
// scale = max(|x|) / 127 (at least FLT_MIN / 127, so a zero row divides safely);
// q = round_half_even(x / scale) + 128. gpu/packed_linear.py's quantize_rows_torch is the reference.
#pragma once

#include "cpu_math.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

namespace actorserve {

constexpr int kZeroPoint = 128;  // oneDNN's fast int8 kernels take unsigned activations: q + 128

// Writes dim values round_half_even(x / scale) + Offset to q; returns the row's scale. Offset 0
// into int8: the KV cache's rows (kv_rows.h).
template <int Offset = kZeroPoint, typename T, typename Q>
inline float quantize_row(const T* x, int64_t dim, Q* q) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(load_f32(x + d)));
  const float s = std::max(amax, FLT_MIN) / 127.f;
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    q[d] = static_cast<Q>(static_cast<int>(std::nearbyint(load_f32(x + d) / s)) + Offset);
  }
  return s;
}

}  // namespace actorserve
