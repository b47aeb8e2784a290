// The transformer's small elementwise chains in one pass each, on a CPU.
//
// In PyTorch each of RMSNorm, SiLU-and-multiply and RoPE is four to eight separate ops, each a
// pass over the activations (and, on a decode step, each a few microseconds of dispatch). These
// do one pass and round to the tensor's dtype exactly where the torch code in gpu/models.py
// rounds, so both paths agree bit for bit wherever the float32 math does.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "kv_rows.h"
#include "parallel.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using actorserve::load_f32;
using actorserve::round_to;
using actorserve::store_f32;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on a CPU");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, name, " needs a contiguous last dimension");
}

// torch: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype). With `residual`, first
// residual += x (rounded to the dtype, as `hidden + delta` is) and normalise the sum.
template <typename T>
void rms_norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const T* xd = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* res = residual ? residual->data_ptr<T>() : nullptr;
  T* od = out.data_ptr<T>();
  actorserve::parallel_for(rows, 16, [&](int64_t first, int64_t last) {
    std::vector<float> v(dim);
    for (int64_t r = first; r < last; ++r) {
      const T* src = xd + r * dim;
      float sum = 0.f;
      if (res) {
        T* acc = res + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) {
          v[d] = round_to<T>(load_f32(acc + d) + load_f32(src + d));
          store_f32(acc + d, v[d]);
        }
      } else {
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) v[d] = load_f32(src + d);
      }
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < dim; ++d) sum += v[d] * v[d];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
      T* o = od + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) store_f32(o + d, load_f32(w + d) * round_to<T>(v[d] * inv));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [", x.size(-1), "] in x's dtype");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm",
                                  [&] { rms_norm_rows<scalar_t>(x, nullptr, weight, eps, out); });
  return out;
}

// residual += x in place; returns rms_norm(residual).
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual and x must match");
  TORCH_CHECK(residual.is_contiguous() && x.is_contiguous(), "residual and x must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [", x.size(-1), "] in x's dtype");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_",
                                  [&] { rms_norm_rows<scalar_t>(x, &residual, weight, eps, out); });
  return out;
}

// torch: silu(gate) * up, each rounded to the dtype; gate_up is [rows, 2 * inter] (gate first).
template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t inter = out.size(-1), rows = out.numel() / inter;
  const T* in = gate_up.data_ptr<T>();
  T* od = out.data_ptr<T>();
  actorserve::parallel_for(rows, 4, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* gate = in + r * 2 * inter;
      const T* up = gate + inter;
      T* o = od + r * inter;
#pragma omp simd
      for (int64_t d = 0; d < inter; ++d) {
        const float silu = round_to<T>(actorserve::silu(load_f32(gate + d)));
        store_f32(o + d, silu * load_f32(up + d));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "gate_up must be contiguous with an even last dimension");
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  auto out = at::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] { silu_mul_rows<scalar_t>(gate_up, out); });
  return out;
}

// torch (half-split layout): x * cos + rotate_half(x) * sin with cos/sin first cast to the dtype,
// each product and the sum rounded to it. In place on x: [tokens, heads, dim] with any strides
// but a contiguous last dimension; cos/sin: [positions, dim] float32 tables.
template <typename T>
void rope_rows(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xd = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  actorserve::parallel_for(tokens, 4, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const float* c = cd + pos[t] * dim;
      const float* s = sd + pos[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xd + t * s0 + h * s1;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = load_f32(v + i), b = load_f32(v + i + half);
          const float ca = round_to<T>(c[i]), sa = round_to<T>(s[i]);
          const float cb = round_to<T>(c[i + half]), sb = round_to<T>(s[i + half]);
          store_f32(v + i, round_to<T>(a * ca) + round_to<T>(-b * sa));
          store_f32(v + i + half, round_to<T>(b * cb) + round_to<T>(a * sb));
        }
      }
    }
  });
}

void rope_(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0, "x must be [tokens, heads, even dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "positions must be int64 [tokens]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.dim() == 2 && cos.size(1) == x.size(2) && cos.sizes() == sin.sizes(),
              "cos and sin must be float32 [positions, dim]");
  // A plain loop: an ATen reduction plus two .item() calls cost more than the rotation of a decode step.
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "a position is outside the rotary table");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] { rope_rows<scalar_t>(x, positions, cos, sin); });
}

// The new tokens' K and V rows copied into their pool slots: what `pool[slots] = k` does, without
// index_put's per-call setup (~40 us for a decode step's 64 rows, twice per layer).
// k_pool, v_pool: contiguous [slots, kv_heads, dim] in k's dtype, or [slots, kv_heads, dim + 4]
// int8 rows, which each head's values are rounded into with their scale (kv_rows.h); slots: int64
// [tokens]; k, v: [tokens, kv_heads, dim], any strides but a contiguous last dimension.
void write_kv_(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "the pools must be contiguous [slots, kv_heads, dim], both the same");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1, "slots must be int64 [tokens]");
  const bool int8_rows = actorserve::int8_rows(k_pool);
  const int64_t dim = k_pool.size(2) - (int8_rows ? actorserve::kRowScaleBytes : 0);
  for (const auto* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(0) == slots.numel() && x->size(1) == k_pool.size(1) && x->size(2) == dim,
                "k and v must be [tokens, kv_heads, dim] matching the pools");
    TORCH_CHECK(int8_rows || x->scalar_type() == k_pool.scalar_type(), "k and v must be in the pools' dtype");
    TORCH_CHECK(x->scalar_type() == k.scalar_type() && x->stride(2) == 1, "k and v need one dtype and a contiguous last dimension");
  }
  const int64_t heads = k_pool.size(1), row_bytes = k_pool.size(2) * k_pool.element_size();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < k_pool.size(0), "slots[", t, "] = ", s[t], " is not a slot of the pool");
  }
  // Slots lie anywhere in the pool, and each row written misses the cache: asked for all at once,
  // the misses overlap, where row by row each write waited for its line.
  for (const auto* pool : {&k_pool, &v_pool}) {
    const auto* base = static_cast<const char*>(pool->data_ptr());
    for (int64_t t = 0; t < slots.numel(); ++t) {
      const char* row = base + s[t] * heads * row_bytes;
      for (int64_t line = 0; line < heads * row_bytes; line += 64) __builtin_prefetch(row + line, 1, 3);
    }
  }
  for (const auto& [pool, x] : {std::pair<at::Tensor*, const at::Tensor*>{&k_pool, &k}, {&v_pool, &v}}) {
    auto* dst = static_cast<char*>(pool->data_ptr());
    const auto* src = static_cast<const char*>(x->data_ptr());
    const int64_t token_stride = x->stride(0) * x->element_size(), head_stride = x->stride(1) * x->element_size();
    for (int64_t t = 0; t < slots.numel(); ++t) {
      char* row = dst + s[t] * heads * row_bytes;
      if (int8_rows) {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x->scalar_type(), "write_kv_", [&] {
          for (int64_t h = 0; h < heads; ++h)
            actorserve::quantize_kv_row(reinterpret_cast<const scalar_t*>(src + t * token_stride + h * head_stride), dim,
                                        reinterpret_cast<int8_t*>(row + h * row_bytes));
        });
      } else if (head_stride == row_bytes) {  // the token's heads lie back to back: one copy
        std::memcpy(row, src + t * token_stride, heads * row_bytes);
      } else {
        for (int64_t h = 0; h < heads; ++h) std::memcpy(row + h * row_bytes, src + t * token_stride + h * head_stride, row_bytes);
      }
    }
  }
}

// Greedy sampling: each row's argmax as torch's `max(dim=-1).indices` picks it, the first of
// equal maxima, and the first NaN where a row has one. torch's reduction over a bfloat16 row of
// 49,152 logits is not vectorised (2.7 ms for 64 rows here); this reads each row once, 16 lanes
// at a time, each lane keeping its first maximum.
template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  int64_t i = 0, best_index = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    __m512 lane_best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i lane_index = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0;
    for (; i + 16 <= n && n <= INT32_MAX; i += 16) {
      __m512 v;
      if constexpr (std::is_same_v<T, float>) {
        v = _mm512_loadu_ps(row + i);
      } else {
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i))), 16));
      }
      const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);
      lane_best = _mm512_mask_mov_ps(lane_best, greater, v);
      lane_index = _mm512_mask_mov_epi32(lane_index, greater, index);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
    }
    any_nan = nan != 0;
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, lane_best);
    _mm512_store_si512(indices, lane_index);
    for (int lane = 0; lane < 16 && i > 0; ++lane) {
      if (values[lane] > best || (values[lane] == best && indices[lane] < best_index)) {
        best = values[lane];
        best_index = indices[lane];
      }
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = load_f32(row + i);
    any_nan |= std::isnan(v);
    if (v > best) {
      best = v;
      best_index = i;
    }
  }
  if (any_nan) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(load_f32(row + j))) return j;
    }
  }
  return best_index;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "logits must be a contiguous, non-empty [rows, vocab] CPU tensor");
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  int64_t* od = out.data_ptr<int64_t>();
  const int64_t n = logits.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* ld = logits.data_ptr<scalar_t>();
    actorserve::parallel_for(logits.size(0), 4, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) od[r] = argmax_row(ld + r * n, n);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("write_kv_(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor k, Tensor v) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(actorserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("write_kv_", &write_kv_);
  m.impl("argmax_rows", &argmax_rows);
}
