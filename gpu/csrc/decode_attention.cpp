// Decode attention straight from the paged KV pool, on a CPU.
//
// One query token per request. Each (request, K/V head) task walks the request's slots in the
// request-to-token table, reads each key and value row where it lies in the pool (no gathered
// copy), scores the head's whole query group against it, and keeps a running softmax in float32
// (blocks of BLOCK keys share one rescale). Also returns each query head's log-sum-exp, so a
// caller can merge this result with attention over other keys (a shared prefix) exactly.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "paged_inputs.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using actorserve::exp_nonpositive;

constexpr int64_t BLOCK = 32;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = actorserve::load_f32(src + d);
}

// Rows are scattered over the pool, so the hardware prefetcher cannot see the next one coming.
constexpr int64_t PREFETCH_AHEAD = 4;

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// Attention of `group` query heads (q: [group, dim] floats, already scaled) over keys `begin` to
// `end` of one request, for one K/V head (the pools offset to it). Writes out[group, dim] and
// lse[group]. FIXED_DIM, when not 0, is `dim` known at compile time (unrolled loops).
template <typename T, int64_t FIXED_DIM>
void attend(const float* q, const T* k_pool, const T* v_pool, int64_t slot_stride, const int32_t* slots, int64_t begin,
            int64_t end, int64_t group, int64_t dim, float* acc, float* rows, float* scores, float* out, float* lse) {
  const int64_t DIM = FIXED_DIM ? FIXED_DIM : dim;
  std::vector<float> running_max(group, -std::numeric_limits<float>::infinity());
  std::vector<float> running_sum(group, 0.f);
  std::fill(acc, acc + group * DIM, 0.f);
  for (int64_t start = begin; start < end; start += BLOCK) {
    const int64_t n = std::min(BLOCK, end - start);
    for (int64_t t = 0; t < n; ++t) {
      if (start + t + PREFETCH_AHEAD < end) prefetch_row(k_pool + slots[start + t + PREFETCH_AHEAD] * slot_stride, DIM);
      load_row(k_pool + slots[start + t] * slot_stride, rows + t * DIM, DIM);
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * BLOCK;
      const float* qg = q + g * DIM;
      for (int64_t t = 0; t < n; ++t) s[t] = dot(qg, rows + t * DIM, DIM);
      const float block_max = *std::max_element(s, s + n);
      const float new_max = std::max(running_max[g], block_max);
      const float rescale = exp_nonpositive(running_max[g] - new_max);  // 0 on the first block
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t t = 0; t < n; ++t) {
        s[t] = exp_nonpositive(s[t] - new_max);
        block_sum += s[t];
      }
      running_sum[g] = running_sum[g] * rescale + block_sum;
      running_max[g] = new_max;
      float* a = acc + g * DIM;
#pragma omp simd
      for (int64_t d = 0; d < DIM; ++d) a[d] *= rescale;
    }
    for (int64_t t = 0; t < n; ++t) {
      if (start + t + PREFETCH_AHEAD < end) prefetch_row(v_pool + slots[start + t + PREFETCH_AHEAD] * slot_stride, DIM);
      load_row(v_pool + slots[start + t] * slot_stride, rows + t * DIM, DIM);
    }
    // Head by head, so one head's accumulator stays in registers across the block's values.
    for (int64_t g = 0; g < group; ++g) {
      const float* p = scores + g * BLOCK;
      float* a = acc + g * DIM;
      for (int64_t t = 0; t < n; ++t) {
        const float* v = rows + t * DIM;
#pragma omp simd
        for (int64_t d = 0; d < DIM; ++d) a[d] += p[t] * v[d];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / running_sum[g];
#pragma omp simd
    for (int64_t d = 0; d < DIM; ++d) out[g * DIM + d] = acc[g * DIM + d] * inv;
    lse[g] = running_max[g] + std::log(running_sum[g]);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& req_to_token,
         const at::Tensor& req_rows, const at::Tensor& key_begin, const at::Tensor& key_end, double scale, at::Tensor& out,
         at::Tensor& lse) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_pool.size(1), group = heads / kv_heads;
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k_pool.data_ptr<T>();
  const T* v_data = v_pool.data_ptr<T>();
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t table_stride = req_to_token.stride(0);
  const int64_t* rows = req_rows.data_ptr<int64_t>();
  const int64_t* begins = key_begin.data_ptr<int64_t>();
  const int64_t* ends = key_end.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  float* lse_data = lse.data_ptr<float>();
  const int64_t slot_stride = kv_heads * dim;
  const int64_t num_tasks = batch * kv_heads;
  // Dynamic scheduling: contexts differ, and with them the cost of each task.
#pragma omp parallel num_threads(std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_tasks))))
  {
    std::vector<float> qf(group * dim), acc(group * dim), rows_buf(BLOCK * dim), scores(group * BLOCK), result(group * dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const T* q_head = q_data + (b * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) qf[i] = actorserve::load_f32(q_head + i) * static_cast<float>(scale);
      const T* k_head = k_data + h * dim;
      const T* v_head = v_data + h * dim;
      const int32_t* slots = table + rows[b] * table_stride;
      float* lse_out = lse_data + b * heads + h * group;
      auto call = [&](auto fixed_dim) {
        attend<T, decltype(fixed_dim)::value>(qf.data(), k_head, v_head, slot_stride, slots, begins[b], ends[b], group, dim, acc.data(),
                                               rows_buf.data(), scores.data(), result.data(), lse_out);
      };
      if (dim == 32) call(std::integral_constant<int64_t, 32>{});
      else if (dim == 64) call(std::integral_constant<int64_t, 64>{});
      else if (dim == 128) call(std::integral_constant<int64_t, 128>{});
      else call(std::integral_constant<int64_t, 0>{});
      T* o = out_data + (b * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) actorserve::store_f32(o + i, result[i]);
    }
  }
}

// q: [batch, heads, dim]; k_pool, v_pool: [slots, kv_heads, dim] (same dtype as q);
// req_to_token: [rows, context] int32; req_rows, key_begin, key_end: [batch] int64 (request b
// attends to the slots at positions key_begin[b] .. key_end[b] - 1 of its row, at least one).
// Returns out [batch, heads, dim] in q's dtype and lse [batch, heads] float32.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                                    const at::Tensor& req_to_token, const at::Tensor& req_rows,
                                                    const at::Tensor& key_begin, const at::Tensor& key_end, double scale) {
  actorserve::check_paged_inputs("decode_attention", q, k_pool, v_pool, req_to_token);
  for (const auto* t : {&req_rows, &key_begin, &key_end}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == q.size(0), "req_rows, key_begin and key_end must be int64 [batch]");
  }
  const int64_t* rows = req_rows.data_ptr<int64_t>();
  const int64_t* begins = key_begin.data_ptr<int64_t>();
  const int64_t* ends = key_end.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(rows[b] >= 0 && rows[b] < req_to_token.size(0), "req_rows[", b, "] = ", rows[b], " is not a row of req_to_token");
    TORCH_CHECK(0 <= begins[b] && begins[b] < ends[b] && ends[b] <= req_to_token.size(1), "request ", b, "'s key range [",
                begins[b], ", ", ends[b], ") is empty or outside req_to_token's ", req_to_token.size(1), " columns");
  }
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    run<scalar_t>(q, k_pool, v_pool, req_to_token, req_rows, key_begin, key_end, scale, out, lse);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(actorserve, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor req_to_token, Tensor req_rows, Tensor key_begin, Tensor key_end, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(actorserve, CPU, m) { m.impl("decode_attention", &decode_attention); }
