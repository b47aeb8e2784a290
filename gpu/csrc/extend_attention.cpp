// Causal attention for new tokens (prefill, extend after a cached prefix), straight from the
// paged KV pool, on a CPU.
//
// The new tokens' K/V are already in the pool, so query token j of request b (position
// prefix[b] + j) attends to the slots at positions 0 .. prefix[b] + j of its table row. A task is
// one request, one K/V head and a tile of TILE consecutive query positions; the tile's queries
// are laid out position-minor so one vector holds a score for every position of the tile and
// no dot product needs a horizontal sum. Keys come in blocks of BLOCK; a block entirely past
// the tile's last position is never read (causal skipping), and a running softmax in float32
// carries the tile across blocks.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "kv_rows.h"
#include "paged_inputs.h"

namespace {

using actorserve::exp_nonpositive;
using actorserve::load_f32;
using actorserve::store_f32;

constexpr int64_t TILE = 16;   // query positions per task: one float vector of scores
constexpr int64_t BLOCK = 32;  // keys per softmax update

// Eight floats: GCC and Clang map this vector extension to one 256-bit register where the CPU has
// them (two SSE registers elsewhere), so the sums below stay in registers.
using Vec8 = float __attribute__((vector_size(8 * sizeof(float))));
// Eight floats anywhere in memory (GCC turned memcpy into a Vec8 into two 16-byte stores and a
// 32-byte load, which the store buffer cannot forward).
using UnalignedVec8 = float __attribute__((vector_size(8 * sizeof(float)), aligned(alignof(float)), may_alias));
inline const UnalignedVec8& vec8_at(const float* p) { return *reinterpret_cast<const UnalignedVec8*>(p); }
inline UnalignedVec8& vec8_at(float* p) { return *reinterpret_cast<UnalignedVec8*>(p); }
static_assert(TILE == 16, "score_keys holds a tile's scores of one key in two Vec8");
constexpr int64_t KEYS_AT_ONCE = 4;  // 8 independent sums: FMAs issue back to back despite their latency
static_assert(BLOCK % KEYS_AT_ONCE == 0, "a block's keys come KEYS_AT_ONCE at a time");

// The tile's scores (q_t: its queries, scaled, position-minor) against keys[0 .. KEYS_AT_ONCE)
// (rows of `dim`), to p[t * TILE + i].
// A float[TILE] running sum lived on the stack, each FMA waiting on the last one's store: prefill
// attention spent over half its time there.
inline void score_keys(const float* q_t, const float* keys, int64_t dim, float* p) {
  Vec8 sum[KEYS_AT_ONCE][2] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const Vec8 lo = vec8_at(q_t + d * TILE), hi = vec8_at(q_t + d * TILE + 8);
    for (int64_t j = 0; j < KEYS_AT_ONCE; ++j) {
      const float k = keys[j * dim + d];
      sum[j][0] += lo * k;
      sum[j][1] += hi * k;
    }
  }
  for (int64_t j = 0; j < KEYS_AT_ONCE; ++j) {
    vec8_at(p + j * TILE) = sum[j][0];
    vec8_at(p + j * TILE + 8) = sum[j][1];
  }
}

// One query position's acc = acc * rescale + sum over t < n of p[t * TILE] * values[t] (rows of
// `dim`), 64 columns at a time in eight Vec8 sums, the rest one by one. As float[dim] (the old
// loop) the sums lived on the stack, each FMA again waiting on a store.
inline void accumulate_values(float* acc, float rescale, const float* p, const float* values, int64_t n, int64_t dim) {
  constexpr int64_t SLICE = 64;
  const int64_t vector_end = dim - dim % 8;
  for (int64_t col = 0; col < vector_end; col += SLICE) {
    const int64_t vectors = std::min(SLICE, vector_end - col) / 8;
    Vec8 sum[SLICE / 8];
    for (int64_t v = 0; v < vectors; ++v) sum[v] = vec8_at(acc + col + 8 * v) * rescale;
    for (int64_t t = 0; t < n; ++t) {
      const float pt = p[t * TILE];
      // Unrolled here, early: otherwise GCC's unroll-and-jam takes two keys a pass, 16 sums, and
      // spills half of them to the stack.
#pragma GCC unroll 8
      for (int64_t v = 0; v < vectors; ++v) {
        sum[v] += pt * vec8_at(values + t * dim + col + 8 * v);
      }
    }
    for (int64_t v = 0; v < vectors; ++v) vec8_at(acc + col + 8 * v) = sum[v];
  }
  for (int64_t col = vector_end; col < dim; ++col) {
    float sum = acc[col] * rescale;
    for (int64_t t = 0; t < n; ++t) sum += p[t * TILE] * values[t * dim + col];
    acc[col] = sum;
  }
}

struct Task {
  int64_t request, kv_head, first;  // first: index of the tile's first new token in the request
};

struct Scratch {
  std::vector<float> q_t;     // [group][dim][TILE] scaled queries, position-minor
  std::vector<float> keys;    // [BLOCK][dim]
  std::vector<float> values;  // [BLOCK][dim]
  std::vector<float> probs;   // [group][BLOCK][TILE]
  std::vector<float> acc;     // [group][TILE][dim]
  std::vector<float> max, sum;  // [group][TILE]
  Scratch(int64_t group, int64_t dim)
      : q_t(group * dim * TILE), keys(BLOCK * dim), values(BLOCK * dim), probs(group * BLOCK * TILE), acc(group * TILE * dim),
        max(group * TILE), sum(group * TILE) {}
};

template <typename T, typename P, int64_t FIXED_DIM>
void attend_tile(const T* q, int64_t q_row_stride, T* out, int64_t out_row_stride, const P* k_pool, const P* v_pool, int64_t slot_stride, const int32_t* slots,
                 int64_t first_pos, int64_t tile, int64_t group, int64_t dim_arg, float scale, Scratch& s) {
  const int64_t DIM = FIXED_DIM ? FIXED_DIM : dim_arg;
  // Rows past the tile's end repeat its last query: computed, never stored.
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < TILE; ++i) {
      const T* row = q + std::min(i, tile - 1) * q_row_stride + g * DIM;
      for (int64_t d = 0; d < DIM; ++d) s.q_t[(g * DIM + d) * TILE + i] = load_f32(row + d) * scale;
    }
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.max.begin(), s.max.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.end(), 0.f);
  float position[TILE];
  for (int64_t i = 0; i < TILE; ++i) position[i] = static_cast<float>(first_pos + std::min(i, tile - 1));
  const int64_t end = first_pos + tile;  // keys 0 .. end - 1 are visible to some row
  for (int64_t start = 0; start < end; start += BLOCK) {
    const int64_t n = std::min(BLOCK, end - start);
    for (int64_t t = 0; t < n; ++t) {
      actorserve::load_row(k_pool + slots[start + t] * slot_stride, s.keys.data() + t * DIM, DIM);
      actorserve::load_row(v_pool + slots[start + t] * slot_stride, s.values.data() + t * DIM, DIM);
    }
    const bool masked = start + n - 1 > first_pos;  // some key here lies past some row's position
    for (int64_t g = 0; g < group; ++g) {
      float* p = s.probs.data() + g * BLOCK * TILE;
      const float* qg = s.q_t.data() + g * DIM * TILE;
      float block_max[TILE];
      std::fill(block_max, block_max + TILE, -std::numeric_limits<float>::infinity());
      // Keys n .. up to the next multiple of KEYS_AT_ONCE (stale rows of the scratch) are scored and never read.
      for (int64_t t = 0; t < n; t += KEYS_AT_ONCE) score_keys(qg, s.keys.data() + t * DIM, DIM, p + t * TILE);
      for (int64_t t = 0; t < n; ++t) {
        float* score = p + t * TILE;
        if (masked) {
          const float key_pos = static_cast<float>(start + t);
#pragma omp simd
          for (int64_t i = 0; i < TILE; ++i) score[i] = key_pos <= position[i] ? score[i] : -std::numeric_limits<float>::infinity();
        }
#pragma omp simd
        for (int64_t i = 0; i < TILE; ++i) block_max[i] = std::max(block_max[i], score[i]);
      }
      float* m = s.max.data() + g * TILE;
      float* l = s.sum.data() + g * TILE;
      float rescale[TILE], block_sum[TILE] = {};
#pragma omp simd
      for (int64_t i = 0; i < TILE; ++i) {
        const float new_max = std::max(m[i], block_max[i]);  // finite: key 0 is in the first block
        rescale[i] = exp_nonpositive(m[i] - new_max);
        m[i] = new_max;
      }
      for (int64_t t = 0; t < n; ++t) {
#pragma omp simd
        for (int64_t i = 0; i < TILE; ++i) {
          p[t * TILE + i] = exp_nonpositive(p[t * TILE + i] - m[i]);
          block_sum[i] += p[t * TILE + i];
        }
      }
#pragma omp simd
      for (int64_t i = 0; i < TILE; ++i) l[i] = l[i] * rescale[i] + block_sum[i];
      for (int64_t i = 0; i < TILE; ++i) accumulate_values(s.acc.data() + (g * TILE + i) * DIM, rescale[i], p + i, s.values.data(), n, DIM);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < tile; ++i) {
      const float inv = 1.f / s.sum[g * TILE + i];
      const float* a = s.acc.data() + (g * TILE + i) * DIM;
      T* o = out + i * out_row_stride + g * DIM;
#pragma omp simd
      for (int64_t d = 0; d < DIM; ++d) store_f32(o + d, a[d] * inv);
    }
}

template <typename T, typename P>
void run(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& req_to_token,
         const std::vector<int64_t>& rows, const std::vector<int64_t>& prefix, const std::vector<int64_t>& extend,
         const std::vector<int64_t>& token_start, double scale, at::Tensor& out) {
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_pool.size(1), group = heads / kv_heads;
  std::vector<Task> tasks;
  for (int64_t b = 0; b < static_cast<int64_t>(rows.size()); ++b)
    for (int64_t first = extend[b] - 1 - (extend[b] - 1) % TILE; first >= 0; first -= TILE)  // longest tiles first
      for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({b, h, first});
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const Task& x, const Task& y) { return prefix[x.request] + x.first > prefix[y.request] + y.first; });
  const T* q_data = q.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const P* k_data = static_cast<const P*>(k_pool.const_data_ptr());
  const P* v_data = static_cast<const P*>(v_pool.const_data_ptr());
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t row = actorserve::row_elems<P>(dim), slot_stride = kv_heads * row;
  const int64_t table_stride = req_to_token.stride(0), q_row_stride = q.stride(0), out_row_stride = heads * dim;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  // Dynamic scheduling: tiles late in a long prompt cost many times the early ones.
#pragma omp parallel num_threads(std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_tasks))))
  {
    Scratch scratch(group, dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < num_tasks; ++j) {
      const Task& task = tasks[j];
      const int64_t b = task.request, tile = std::min(TILE, extend[b] - task.first);
      const int64_t head_offset = task.kv_head * group * dim, first_token = token_start[b] + task.first;
      const P* k_head = k_data + task.kv_head * row;
      const P* v_head = v_data + task.kv_head * row;
      const int32_t* slots = table + rows[b] * table_stride;
      const int64_t first_pos = prefix[b] + task.first;
      auto call = [&](auto fixed_dim) {
        attend_tile<T, P, decltype(fixed_dim)::value>(q_data + first_token * q_row_stride + head_offset, q_row_stride,
                                                   out_data + first_token * out_row_stride + head_offset, out_row_stride, k_head, v_head, slot_stride, slots,
                                                   first_pos, tile, group, dim, static_cast<float>(scale), scratch);
      };
      if (dim == 32) call(std::integral_constant<int64_t, 32>{});
      else if (dim == 64) call(std::integral_constant<int64_t, 64>{});
      else if (dim == 128) call(std::integral_constant<int64_t, 128>{});
      else call(std::integral_constant<int64_t, 0>{});
    }
  }
}

std::vector<int64_t> to_vector(const at::Tensor& t, int64_t size, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.numel() == size, name, " must be int64 [batch]");
  auto c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + size);
}

// q: [tokens, heads, dim], the new tokens packed request after request; k_pool, v_pool: [slots,
// kv_heads, dim] (or int8 rows, kv_rows.h), already holding the new tokens' K/V; req_to_token: [rows, context] int32;
// req_rows, prefix_lens, extend_lens: [batch] int64. Returns [tokens, heads, dim] in q's dtype.
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& req_to_token,
                            const at::Tensor& req_rows, const at::Tensor& prefix_lens, const at::Tensor& extend_lens, double scale) {
  actorserve::check_paged_inputs("extend_attention", q, k_pool, v_pool, req_to_token);
  const int64_t batch = req_rows.numel();
  const auto rows = to_vector(req_rows, batch, "req_rows");
  const auto prefix = to_vector(prefix_lens, batch, "prefix_lens");
  const auto extend = to_vector(extend_lens, batch, "extend_lens");
  std::vector<int64_t> token_start(batch);
  int64_t tokens = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(rows[b] >= 0 && rows[b] < req_to_token.size(0), "req_rows[", b, "] = ", rows[b], " is not a row of req_to_token");
    TORCH_CHECK(prefix[b] >= 0 && extend[b] >= 1 && prefix[b] + extend[b] <= req_to_token.size(1), "request ", b, "'s positions [0, ",
                prefix[b] + extend[b], ") are empty or outside req_to_token's ", req_to_token.size(1), " columns");
    token_start[b] = tokens;
    tokens += extend[b];
  }
  TORCH_CHECK(tokens == q.size(0), "extend_lens sum to ", tokens, " tokens but q has ", q.size(0));
  auto out = at::empty(q.sizes(), q.options());  // contiguous even when q is a strided view
  actorserve::dispatch_q_and_pool(q, k_pool, [&](auto t, auto p) {
    run<decltype(t), decltype(p)>(q, k_pool, v_pool, req_to_token, rows, prefix, extend, token_start, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve, m) {
  m.def("extend_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor req_to_token, Tensor req_rows, Tensor prefix_lens, Tensor extend_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(actorserve, CPU, m) { m.impl("extend_attention", &extend_attention); }
