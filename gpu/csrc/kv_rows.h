// The rows of a KV pool as the CPU kernels read and write them. A pool holds the model's dtype
// ([slots, kv_heads, dim]), or 8-bit rows (`--kv-cache-dtype int8`: [slots, kv_heads, dim + 4]
// int8): each head's dim values rounded to int8 against the row's own scale, max(|x|) / 127,
// then that scale as a float32 in the row's last four bytes. A row carrying its scale keeps every
// copy of pool rows (the host tier, gathers) a copy of bytes. gpu/kv_quant.py is the reference.
#pragma once

#include "cpu_math.h"
#include "quantize_row.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace actorserve {

constexpr int64_t kRowScaleBytes = 4;

// Elements of one head's row in a pool of P: dim, and the scale's bytes for int8 rows.
template <typename P>
constexpr int64_t row_elems(int64_t dim) {
  return std::is_same_v<P, int8_t> ? dim + kRowScaleBytes : dim;
}

inline float row_scale(const int8_t* row, int64_t dim) {
  float s;
  std::memcpy(&s, row + dim, sizeof s);
  return s;
}

// One pool row as dim floats.
template <typename P>
inline void load_row(const P* src, float* dst, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) dst[d] = load_f32(src + d);
}

inline void load_row(const int8_t* src, float* dst, int64_t dim) {
  const float s = row_scale(src, dim);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]) * s;
}

// dim values of T into one int8 row with its scale.
template <typename T>
inline void quantize_kv_row(const T* x, int64_t dim, int8_t* row) {
  const float s = quantize_row<0>(x, dim, row);
  std::memcpy(row + dim, &s, sizeof s);
}

// Whether `pool` holds int8 rows of `dim` values (else it holds q's dtype, rows of dim).
inline bool int8_rows(const at::Tensor& pool) { return pool.scalar_type() == at::kChar; }

// call(T{}, P{}) with T the queries' element type and P the pools'.
template <typename Call>
void dispatch_q_and_pool(const at::Tensor& q, const at::Tensor& pool, Call call) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged attention", [&] {
    if (int8_rows(pool)) call(scalar_t{}, int8_t{});
    else call(scalar_t{}, scalar_t{});
  });
}

}  // namespace actorserve
