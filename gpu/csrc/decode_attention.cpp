// Decode attention straight from the paged KV pool, on a CPU.
//
// One query token per request. Each task (a request, and one or several of its K/V heads) walks the
// request's slots in the request-to-token table, reads each key and value row where it lies in the
// pool (no gathered copy), scores each head's whole query group against it, and keeps a running
// softmax in float32 (blocks of BLOCK keys share one rescale). Also returns each query head's
// log-sum-exp, so a caller can merge this result with attention over other keys (a shared prefix)
// exactly.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "kv_rows.h"
#include "paged_inputs.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// vdpbf16ps where the compiler targets it (-march=native on a CPU with AVX512-BF16). A test build
// may force the path with -DACTORSERVE_BF16_DOT and an emulation of the intrinsics.
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && !defined(ACTORSERVE_BF16_DOT)
#define ACTORSERVE_BF16_DOT 1
#endif
// The score layout the vector paths share (namespace quad) comes in 512-bit lanes (AVX-512F, which
// the bfloat16 path needs) and 256-bit lanes (AVX2 and FMA); the float32 path is compiled for each
// width the compiler targets, and `decode_attention_widths` lists them.
#if defined(__AVX512F__) || defined(ACTORSERVE_BF16_DOT)
#define ACTORSERVE_LANES16 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define ACTORSERVE_LANES8 1
#endif
#if defined(ACTORSERVE_LANES16) || defined(ACTORSERVE_LANES8)
#define ACTORSERVE_QUAD_SCORES 1
#include <immintrin.h>
#endif
// ACTORSERVE_EMULATE_AVX512: a test build with every 512-bit path, its intrinsics emulated.
#if defined(ACTORSERVE_LANES16) && (defined(__AVX512F__) || defined(ACTORSERVE_EMULATE_AVX512))
#define ACTORSERVE_F32_LANES16 1
#endif
// int8 pools' scores by vpdpbusd (AVX512-VNNI), their values converted to float32 (AVX-512F).
#if defined(ACTORSERVE_F32_LANES16) && ((defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(ACTORSERVE_EMULATE_AVX512))
#define ACTORSERVE_INT8_DOT 1
#endif

namespace {

using actorserve::exp_nonpositive;
using actorserve::load_row;
using actorserve::row_elems;

// Keys per block: scores, softmax update and P.V run a block at a time, and the next block's rows
// are fetched meanwhile. 16 rather than 32: smaller bursts of prefetches (AVX-512 EPYC, batch 64 x
// 256 keys out of cache: a bfloat16 layer 1.29x faster, its decode step 1.16x; int8 K/V 1.02x; the
// same in cache).
constexpr int64_t BLOCK = 16;

// Rows are scattered over the pool, so the hardware prefetcher cannot see the next one coming.
constexpr int64_t PREFETCH_AHEAD = 16;

// Into L2, not L1 (locality 2: prefetcht1): a block's rows are a hundred or more lines, more than
// L1's few outstanding misses take, and L1-bound prefetches past those wait or drop. Out of cache
// (30 layers' pools, batch 64, 256 keys each) a bfloat16 layer took 0.70 ms instead of 1.0.
// Every line of the `count` elements from `first` (for pool rows: an int8 row's scale included).
template <typename T>
inline void prefetch_elems(const T* first, int64_t count) {
  const uintptr_t line0 = reinterpret_cast<uintptr_t>(first) & ~uintptr_t{63};
  const uintptr_t last = reinterpret_cast<uintptr_t>(first + count) - 1;
  for (uintptr_t line = line0; line <= last; line += 64) __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
}

template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  prefetch_elems(row, row_elems<T>(dim));
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// Query heads a P.V pass of the 512-bit paths takes at once, for rows of 32 * CHUNKS elements: 2 *
// CHUNKS accumulator vectors a head, sixteen in all.
template <int64_t CHUNKS>
constexpr int heads_per_pass() { return static_cast<int>(8 / CHUNKS); }

// call(std::integral_constant<int, h>) for 1 <= h <= Max: a pass's head count as a compile-time
// constant, so that its accumulators are an array of registers.
template <int Max, typename Call>
inline void with_count(int64_t h, Call call) {
  if constexpr (Max > 1) {
    if (h < Max) return with_count<Max - 1>(h, call);
  }
  call(std::integral_constant<int, Max>{});
}

// call(count, first) for `group` query heads in passes of at most Max from head `first` on, count
// (the pass's heads) a with_count constant.
template <int Max, typename Call>
inline void for_each_head_pass(int64_t group, Call call) {
  for (int64_t first = 0; first < group; first += Max)
    with_count<Max>(std::min<int64_t>(Max, group - first), [&](auto count) { call(count, first); });
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

#ifdef ACTORSERVE_QUAD_SCORES
// A vector of float32 lanes, as the quad code below uses it: Lanes16 (AVX-512F) and Lanes8 (AVX2).
#ifdef ACTORSERVE_LANES16
struct Lanes16 {
  using Reg = __m512;
  static constexpr int64_t N = 16;
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Reg x) { _mm512_storeu_ps(p, x); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg fnmadd(Reg a, Reg b, Reg c) { return _mm512_fnmadd_ps(a, b, c); }
  template <int IMM>
  static Reg shuffle(Reg a, Reg b) { return _mm512_shuffle_ps(a, b, IMM); }
  static Reg broadcast4(const float* p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }
  static Reg round(Reg x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static Reg scale_pow2(Reg p, Reg n) { return _mm512_scalef_ps(p, n); }
  // y, with 0 where x < limit (NaN lanes keep y).
  static Reg zero_below(Reg y, Reg x, float limit) {
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, set1(limit), _CMP_LT_OQ)), y);
  }
  // x * scale in lanes 4h + i with i < valid, -inf in the others.
  static Reg scale_live(Reg x, int64_t valid, Reg scale) {
    const __mmask16 live = static_cast<__mmask16>(((1u << valid) - 1) * 0x1111u);
    return _mm512_mask_mul_ps(set1(-std::numeric_limits<float>::infinity()), live, x, scale);
  }
};
#endif

#ifdef ACTORSERVE_LANES8
struct Lanes8 {
  using Reg = __m256;
  static constexpr int64_t N = 8;
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Reg x) { _mm256_storeu_ps(p, x); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg fnmadd(Reg a, Reg b, Reg c) { return _mm256_fnmadd_ps(a, b, c); }
  template <int IMM>
  static Reg shuffle(Reg a, Reg b) { return _mm256_shuffle_ps(a, b, IMM); }
  static Reg broadcast4(const float* p) { return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p)); }
  static Reg round(Reg x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^n through the exponent bits: n is integral in [-126, 0] here (exp of x >= -87).
  static Reg scale_pow2(Reg p, Reg n) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  static Reg zero_below(Reg y, Reg x, float limit) { return _mm256_and_ps(y, _mm256_cmp_ps(x, set1(limit), _CMP_NLT_UQ)); }
  static Reg scale_live(Reg x, int64_t valid, Reg scale) {
    const Reg live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3), set1(static_cast<float>(valid)), _CMP_LT_OQ);
    return _mm256_blendv_ps(set1(-std::numeric_limits<float>::infinity()), mul(x, scale), live);
  }
};
#endif

// Score vectors of N / 4 query heads, a 128-bit quarter each, as the bfloat16 and float32 paths
// below compute them: a key's pieces are broadcast to all quarters, so each instruction advances
// every head of the vector at once and a key leaves 4 partial sums per head. Two rounds of
// in-quarter pair folds turn four keys' partials into one vector of scores (quarter h: head h
// against those four keys), a shuffle and an add per score where a per-head horizontal sum takes
// about four. The softmax runs in that layout: every lane of a quarter carries its head's running
// maximum and sum. W: Lanes16 (four heads a vector) or Lanes8 (two).
namespace quad {

constexpr int64_t QUAD_KEYS = 4;  // keys per score vector
constexpr int64_t VECS = BLOCK / QUAD_KEYS;  // score vectors per block and head quad

template <typename W>
constexpr int64_t heads() { return W::N / 4; }  // query heads per score vector

// exp(x) for x <= 0, every lane: exp_nonpositive's polynomial, scaled by 2^n.
template <typename W>
inline typename W::Reg exp_nonpositive(typename W::Reg x) {
  const auto clamped = W::max(W::set1(-87.f), x);  // NaN stays NaN
  const auto n = W::round(W::mul(clamped, W::set1(1.44269504f)));
  auto r = W::fnmadd(n, W::set1(0.693145752f), clamped);
  r = W::fnmadd(n, W::set1(1.42860677e-6f), r);
  auto p = W::set1(1.98756912e-4f);
  p = W::fmadd(p, r, W::set1(1.39819994e-3f));
  p = W::fmadd(p, r, W::set1(8.33345205e-3f));
  p = W::fmadd(p, r, W::set1(4.16657962e-2f));
  p = W::fmadd(p, r, W::set1(1.66666657e-1f));
  p = W::fmadd(p, r, W::set1(0.5f));
  p = W::fmadd(W::mul(p, r), r, W::add(r, W::set1(1.f)));
  return W::zero_below(W::scale_pow2(p, n), x, -87.f);
}

// Within each quarter: [a0+a1, a2+a3, b0+b1, b2+b3].
template <typename W>
inline typename W::Reg fold_pairs(typename W::Reg a, typename W::Reg b) {
  return W::add(W::template shuffle<0x88>(a, b), W::template shuffle<0xDD>(a, b));
}

// Within each quarter, every lane set to the quarter's maximum / sum.
template <typename W>
inline typename W::Reg quarter_max(typename W::Reg x) {
  x = W::max(x, W::template shuffle<0xB1>(x, x));
  return W::max(x, W::template shuffle<0x4E>(x, x));
}
template <typename W>
inline typename W::Reg quarter_sum(typename W::Reg x) {
  x = W::add(x, W::template shuffle<0xB1>(x, x));
  return W::add(x, W::template shuffle<0x4E>(x, x));
}

// Scores of one vector's heads against a block's keys (partials(t): their partial sums against key
// t < BLOCK, lane 4h + i; scales(j): the factors of score vector j's lanes; keys past n masked),
// then the online softmax update: each score vector's probabilities go to store(j, p), each head's
// rescale into the state ([3][N]: running max, running sum, this block's rescale).
template <typename W, typename Partials, typename Scales, typename Store>
inline void score_block(Partials partials, int64_t n, Scales scales, Store store, float* state) {
  typename W::Reg s[VECS];
  for (int64_t j = 0; j < VECS; ++j) {
    const int64_t t = QUAD_KEYS * j;
    const auto ab = fold_pairs<W>(partials(t), partials(t + 1));
    const auto cd = fold_pairs<W>(partials(t + 2), partials(t + 3));
    s[j] = W::scale_live(fold_pairs<W>(ab, cd), std::clamp<int64_t>(n - t, 0, QUAD_KEYS), scales(j));
  }
  auto block_max = s[0];
  for (int64_t j = 1; j < VECS; ++j) block_max = W::max(block_max, s[j]);
  const auto old_max = W::load(state);
  const auto new_max = W::max(old_max, quarter_max<W>(block_max));  // finite: key `start` is live
  const auto rescale = exp_nonpositive<W>(W::sub(old_max, new_max));  // 0 on the first block
  auto sum = W::zero();
  for (int64_t j = 0; j < VECS; ++j) {
    const auto p = exp_nonpositive<W>(W::sub(s[j], new_max));
    sum = W::add(sum, p);
    store(j, p);
  }
  W::store(state, new_max);
  W::store(state + W::N, W::fmadd(W::load(state + W::N), rescale, quarter_sum<W>(sum)));
  W::store(state + 2 * W::N, rescale);
}

// Resets a vector's state for a new task: no maximum yet, sums of 0.
template <typename W>
inline void reset_state(float* state) {
  std::fill(state, state + W::N, -std::numeric_limits<float>::infinity());
  std::fill(state + W::N, state + 2 * W::N, 0.f);
}

// Every score vector's probabilities (probs: [vectors][VECS][N]) times their value rows' scales
// (key t's at value_scale[t]), so that the int8 rows weigh in as they are stored.
template <typename W>
inline void scale_by_rows(float* probs, int64_t vectors, const float* value_scale) {
  for (int64_t w = 0; w < vectors; ++w)
    for (int64_t j = 0; j < VECS; ++j) {
      float* p = probs + (w * VECS + j) * W::N;
      W::store(p, W::mul(W::load(p), W::broadcast4(value_scale + QUAD_KEYS * j)));
    }
}

// The `group` heads' outputs (their accumulators over their running sums) and log-sum-exps, from
// the states of their vectors ([vectors][3][N]).
template <typename W>
inline void finish(const float* acc, const float* state, int64_t group, int64_t dim, float* out, float* lse) {
  for (int64_t g = 0; g < group; ++g) {
    const float* head = state + (g / heads<W>()) * 3 * W::N + 4 * (g % heads<W>());
    const float inv = 1.f / head[W::N];
    for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = acc[g * dim + d] * inv;
    lse[g] = head[0] + std::log(head[W::N]);
  }
}

}  // namespace quad
#endif

// The rows of keys `begin` to `end` (at most a block) of `span` elements each from both pools into the cache.
template <typename Row>
inline void prefetch_first_block(const Row* k_pool, const Row* v_pool, int64_t slot_stride, const int32_t* slots, int64_t begin,
                                 int64_t end, int64_t span) {
  for (int64_t t = begin; t < std::min(end, begin + BLOCK); ++t) {
    prefetch_elems(k_pool + slots[t] * slot_stride, span);
    prefetch_elems(v_pool + slots[t] * slot_stride, span);
  }
}

// Walks one task's keys (`begin` to `end` of its slots) a block at a time, for `task_heads` K/V heads
// whose rows follow each other in a slot (the pools offset to the first): the block's key rows of
// head h (past n, the last row again) go to score(h, keys, n), head by head, then its value rows
// to accumulate(h, values, n). So a slot's rows of all the task's heads are read as one run of
// lines, where a task per K/V head read a piece of each run and left the rest to other tasks (AVX2,
// SmolLM2's three heads, int8 rows in contiguous slots, out of cache: 1.38x as long). Rows may be
// scattered over the pool, so the next block's keys are fetched while this one's are scored, its
// values while this one's are summed, a share before each head: bursts of a whole block's lines
// stalled on the cache's misses in flight (AVX-512 EPYC, batch 64 x 256 keys out of cache: a
// bfloat16 layer 1.21x as long in one burst per pool as in three, an int8 one 1.13x).
template <typename Row, typename Score, typename Accumulate>
inline void for_each_block(const Row* k_pool, const Row* v_pool, int64_t slot_stride, const int32_t* slots, int64_t begin, int64_t end,
                           int64_t dim, int64_t task_heads, Score score, Accumulate accumulate) {
  const int64_t row = row_elems<Row>(dim), span = task_heads * row;
  const Row* keys[BLOCK];
  const Row* values[BLOCK];
  for (int64_t start = begin; start < end; start += BLOCK) {
    const int64_t n = std::min(BLOCK, end - start);
    for (int64_t t = 0; t < BLOCK; ++t) {
      const int64_t slot = slots[start + std::min(t, n - 1)];
      keys[t] = k_pool + slot * slot_stride;
      values[t] = v_pool + slot * slot_stride;
    }
    const int64_t next = start + BLOCK, ahead = std::max<int64_t>(0, std::min(end, next + BLOCK) - next);
    auto each_head = [&](const Row* pool, const Row* const* first, auto call) {
      const Row* rows[BLOCK];
      for (int64_t h = 0; h < task_heads; ++h) {
        for (int64_t t = next + h * ahead / task_heads; t < next + (h + 1) * ahead / task_heads; ++t)
          prefetch_elems(pool + slots[t] * slot_stride, span);
        for (int64_t t = 0; t < BLOCK; ++t) rows[t] = first[t] + h * row;
        call(h, rows, n);
      }
    };
    each_head(k_pool, keys, score);
    each_head(v_pool, values, accumulate);
  }
}

#ifdef ACTORSERVE_BF16_DOT
// bfloat16 pools on CPUs with AVX512-BF16 (vdpbf16ps: bf16 pairs multiplied exactly, summed in
// float32). Q.K and P.V both read the pool's rows as they are, with no conversion to float.
//
// Q.K: quad score vectors (above); a key's 8-element pieces are broadcast, so each dot
// instruction advances four heads by 8 elements.
//
// P.V: the probabilities are rounded to bfloat16 (as PyTorch's CPU flash kernel does before its
// P.V) and taken in key pairs; two value rows interleaved element by element make the other
// operand, so each head's accumulators advance two keys per instruction. The interleave permutes
// elements within 128-bit lanes, undone once at the end.
namespace bf16 {

using namespace quad;
using W = Lanes16;
constexpr int64_t HEADS = heads<W>();

// Integer lanes as dot operands: a bit cast, no instruction.
inline __m512bh as_bh(__m512i x) {
  __m512bh r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}

// Four heads' partial sums against one key row: lane 4h + i sums the products of elements
// 8c + 2i, 8c + 2i + 1 over the row's pieces c. q4: the packed queries (see pack_queries), held in
// registers across a block's keys rather than loaded again for each key (loads, not dots, bound
// this kernel in cache).
template <int64_t CHUNKS>
inline __m512 quad_partials(const __m512bh* q4, const uint16_t* key) {
  auto piece = [&](int64_t c) { return as_bh(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key + 8 * c)))); };
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();  // two chains: half the latency
  for (int64_t c = 0; c < 4 * CHUNKS; c += 2) {
    even = _mm512_dpbf16_ps(even, q4[c], piece(c));
    odd = _mm512_dpbf16_ps(odd, q4[c + 1], piece(c + 1));
  }
  return _mm512_add_ps(even, odd);
}

// Query heads first .. first + 3 (zeros past `group`) as dot operands: vector c, lane 4h + i holds
// the pair (q[h][8c + 2i], q[h][8c + 2i + 1]).
inline void pack_queries(const uint16_t* q, int64_t dim, int64_t first, int64_t group, uint32_t* out) {
  for (int64_t c = 0; c < dim / 8; ++c)
    for (int64_t h = 0; h < HEADS; ++h)
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t head = first + h;
        const uint16_t* pair = q + head * dim + 8 * c + 2 * i;
        out[c * 16 + 4 * h + i] = head < group ? static_cast<uint32_t>(pair[0]) | static_cast<uint32_t>(pair[1]) << 16 : 0u;
      }
}

// Scratch of one thread for `attend` (sizes for the largest group and dim).
struct Scratch {
  std::vector<uint32_t> q4;  // [quads][dim / 8][16]
  std::vector<uint16_t> probs;  // [quads][VECS][16] bf16 probabilities in score-vector layout
  std::vector<float> state;  // [quads][3][16]: running max, running sum, this block's rescale
  std::vector<float> acc;  // [group][dim], lanes permuted as the interleave leaves them
  Scratch(int64_t group, int64_t dim)
      : q4(quads(group) * dim / 8 * 16), probs(quads(group) * VECS * 16), state(quads(group) * 48), acc(group * dim) {}
  static int64_t quads(int64_t group) { return (group + HEADS - 1) / HEADS; }
};

// acc = acc * rescale + P.V over the block's key pairs, for G query heads from `first` on (their
// probabilities and rescales in s). Each pair of value rows is loaded once and interleaved element
// by element in registers, and serves all G heads: a pass per head loaded the rows again for each.
// Key t's probability is at probs[16 * (t / 4) + t % 4] past the head's quarter; past n the rows
// repeat the block's last (for_each_block) and the probabilities are 0.
template <int64_t CHUNKS, int64_t G>
inline void accumulate_heads(Scratch& s, int64_t first, const uint16_t* const* rows, int64_t n) {
  constexpr int64_t V = 2 * CHUNKS, DIM = 32 * CHUNKS;
  __m512 a[G][V];
  const uint16_t* p[G];
  for (int64_t g = 0; g < G; ++g) {
    const int64_t w = (first + g) / HEADS, lane = 4 * ((first + g) % HEADS);
    p[g] = s.probs.data() + w * VECS * 16 + lane;
    const __m512 rescale = _mm512_set1_ps(s.state[w * 48 + 32 + lane]);
    for (int64_t v = 0; v < V; ++v) a[g][v] = _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + (first + g) * DIM + 16 * v), rescale);
  }
  for (int64_t t = 0; t < n; t += 2) {
    __m512bh lo[CHUNKS], hi[CHUNKS];
    for (int64_t c = 0; c < CHUNKS; ++c) {
      const __m512i x = _mm512_loadu_si512(rows[t] + 32 * c), y = _mm512_loadu_si512(rows[t + 1] + 32 * c);
      lo[c] = as_bh(_mm512_unpacklo_epi16(x, y));
      hi[c] = as_bh(_mm512_unpackhi_epi16(x, y));
    }
    for (int64_t g = 0; g < G; ++g) {
      uint32_t pair;
      std::memcpy(&pair, p[g] + 16 * (t / 4) + t % 4, sizeof pair);
      const __m512bh probs = as_bh(_mm512_set1_epi32(static_cast<int32_t>(pair)));
      for (int64_t c = 0; c < CHUNKS; ++c) {
        a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], probs, lo[c]);
        a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], probs, hi[c]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(s.acc.data() + (first + g) * DIM + 16 * v, a[g][v]);
}

// Element d of the output from the interleaved accumulator: vector 2c holds elements 32c + 8L + i
// at lane 4L + i, vector 2c + 1 elements 32c + 8L + 4 + i.
inline int64_t interleaved_lane(int64_t d) {
  const int64_t c = d / 32, L = (d % 32) / 8, i = d % 8;
  return 16 * (2 * c + i / 4) + 4 * L + i % 4;
}

// Attention of `group` query heads per K/V head (q: [task_heads][group, 32 * CHUNKS] bf16 bits,
// unscaled) over keys `begin` to `end` of one request, for `task_heads` K/V heads (the pools
// offset to the first; scratch[h] for head h). Writes out[task_heads][group, dim] and
// lse[task_heads][group].
template <int64_t CHUNKS>
void attend(const uint16_t* q, const uint16_t* k_pool, const uint16_t* v_pool, int64_t slot_stride, const int32_t* slots, int64_t begin,
            int64_t end, int64_t task_heads, int64_t group, float scale, Scratch* scratch, float* out, float* lse) {
  constexpr int64_t DIM = 32 * CHUNKS;
  const int64_t quads = Scratch::quads(group);
  for (int64_t h = 0; h < task_heads; ++h) {
    Scratch& s = scratch[h];
    for (int64_t w = 0; w < quads; ++w) {
      pack_queries(q + h * group * DIM, DIM, w * HEADS, group, s.q4.data() + w * DIM / 8 * 16);
      reset_state<W>(s.state.data() + w * 48);
    }
    std::fill(s.acc.begin(), s.acc.begin() + group * DIM, 0.f);
  }
  auto score = [&](int64_t h, const uint16_t* const* keys, int64_t n) {
    Scratch& s = scratch[h];
    for (int64_t w = 0; w < quads; ++w) {
      __m512bh q4[4 * CHUNKS];
      for (int64_t c = 0; c < 4 * CHUNKS; ++c) q4[c] = as_bh(_mm512_loadu_si512(s.q4.data() + w * DIM / 8 * 16 + 16 * c));
      uint16_t* probs = s.probs.data() + w * VECS * 16;
      score_block<W>([&](int64_t t) { return quad_partials<CHUNKS>(q4, keys[t]); }, n, [&](int64_t) { return W::set1(scale); },
                  [&](int64_t j, __m512 p) {
                    const __m256bh rounded = _mm512_cvtneps_pbh(p);
                    std::memcpy(probs + 16 * j, &rounded, sizeof rounded);
                  },
                  s.state.data() + w * 48);
    }
  };
  auto accumulate = [&](int64_t h, const uint16_t* const* values, int64_t n) {
    for_each_head_pass<heads_per_pass<CHUNKS>()>(
        group, [&](auto count, int64_t first) { accumulate_heads<CHUNKS, decltype(count)::value>(scratch[h], first, values, n); });
  };
  for_each_block(k_pool, v_pool, slot_stride, slots, begin, end, DIM, task_heads, score, accumulate);
  for (int64_t h = 0; h < task_heads; ++h)
    for (int64_t g = 0; g < group; ++g) {
      const float* state = scratch[h].state.data() + (g / HEADS) * 48 + 4 * (g % HEADS);
      const float inv = 1.f / state[16];
      float* o = out + (h * group + g) * DIM;
      for (int64_t d = 0; d < DIM; ++d) o[d] = scratch[h].acc[g * DIM + interleaved_lane(d)] * inv;
      lse[h * group + g] = state[0] + std::log(state[16]);
    }
}

}  // namespace bf16
#endif

#ifdef ACTORSERVE_QUAD_SCORES
// float32 pools (CPUs without AVX512-BF16 run their models in float32), for each vector width W
// compiled. Q.K: quad score vectors (above); a key's 4-element pieces are broadcast, so each FMA
// advances every head of the vector by 4 elements. P.V: each head's accumulators take one key per
// FMA, two keys in flight.
namespace f32 {

using namespace quad;

// Query heads first .. first + heads - 1 (zeros past `group`) as FMA operands: vector c, lane
// 4h + i holds q[h][4c + i].
template <typename W>
inline void pack_queries(const float* q, int64_t dim, int64_t first, int64_t group, float* out) {
  for (int64_t c = 0; c < dim / 4; ++c)
    for (int64_t h = 0; h < heads<W>(); ++h)
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t head = first + h;
        out[c * W::N + 4 * h + i] = head < group ? q[head * dim + 4 * c + i] : 0.f;
      }
}

// The vector's heads' partial sums against one key row: lane 4h + i sums q[h][4c + i] * key[4c + i] over c.
template <typename W, int64_t CHUNKS>
inline typename W::Reg quad_partials(const float* q4, const float* key) {
  auto even = W::zero(), odd = W::zero();  // two chains: half the latency
  for (int64_t c = 0; c < 8 * CHUNKS; c += 2) {
    even = W::fmadd(W::load(q4 + W::N * c), W::broadcast4(key + 4 * c), even);
    odd = W::fmadd(W::load(q4 + W::N * (c + 1)), W::broadcast4(key + 4 * (c + 1)), odd);
  }
  return W::add(even, odd);
}

// acc[0 .. S * N) = acc * rescale + P.V over the block's first n value rows (from column `col` on),
// for one head, in CHAINS independent chains of S accumulators.
template <typename W, int64_t S, int64_t CHAINS>
inline void accumulate_slice(const float* p, float rescale, const float* const* rows, int64_t col, int64_t n, float* acc) {
  typename W::Reg a[CHAINS][S];
  for (int64_t v = 0; v < S; ++v) {
    a[0][v] = W::mul(W::load(acc + W::N * v), W::set1(rescale));
    for (int64_t c = 1; c < CHAINS; ++c) a[c][v] = W::zero();
  }
  auto prob = [&](int64_t t) { return W::set1(p[W::N * (t / 4) + t % 4]); };
  int64_t t = 0;
  for (; t + CHAINS <= n; t += CHAINS)
    for (int64_t c = 0; c < CHAINS; ++c) {
      const auto pc = prob(t + c);
      for (int64_t v = 0; v < S; ++v) a[c][v] = W::fmadd(pc, W::load(rows[t + c] + col + W::N * v), a[c][v]);
    }
  for (; t < n; ++t)
    for (int64_t v = 0; v < S; ++v) a[0][v] = W::fmadd(prob(t), W::load(rows[t] + col + W::N * v), a[0][v]);
  for (int64_t v = 0; v < S; ++v) {
    for (int64_t c = 1; c < CHAINS; ++c) a[0][v] = W::add(a[0][v], a[c][v]);
    W::store(acc + W::N * v, a[0][v]);
  }
}

// acc = acc * rescale + P.V over the block's first n value rows, for one head; p: the head's
// probabilities, key t at p[N * (t / 4) + t % 4] (the head's quarter offset applied by the caller).
// Slices of at most 8 vectors of the row, in two chains (twice the independent FMAs) where both
// fit the registers beside the probabilities: AVX2's 16 registers take one chain of 8 (head size
// 64 in float32), where two spilled to the stack (a call at batch 64 took 4.95 ms instead of 4.3
// on one core).
template <typename W, int64_t CHUNKS>
inline void accumulate_values(const float* p, float rescale, const float* const* rows, int64_t n, float* acc) {
  constexpr int64_t V = 32 * CHUNKS / W::N;  // vectors per row
  constexpr int64_t S = std::min<int64_t>(V, 8), REGISTERS = W::N == 16 ? 32 : 16;
  constexpr int64_t CHAINS = 2 * S + 4 <= REGISTERS ? 2 : 1;
  for (int64_t col = 0; col < V * W::N; col += S * W::N) accumulate_slice<W, S, CHAINS>(p, rescale, rows, col, n, acc + col);
}

// Scratch of one thread for `attend` (sizes for the largest group and dim).
template <typename W>
struct Scratch {
  using Lanes = W;
  static constexpr int64_t STATE = 3 * W::N;  // per vector of heads: running max, running sum, this block's rescale
  std::vector<float> q4;  // [vectors][dim / 4][N]
  std::vector<float> probs;  // [vectors][VECS][N] probabilities in score-vector layout
  std::vector<float> state;  // [vectors][STATE]
  std::vector<float> acc;  // [group][dim]
  Scratch(int64_t group, int64_t dim)
      : q4(vectors(group) * dim / 4 * W::N), probs(vectors(group) * VECS * W::N), state(vectors(group) * STATE), acc(group * dim) {}
  static int64_t vectors(int64_t group) { return (group + heads<W>() - 1) / heads<W>(); }
};

// Attention of `group` query heads per K/V head (q: [task_heads][group, 32 * CHUNKS], unscaled) over
// keys `begin` to `end` of one request, for `task_heads` K/V heads (the pools offset to the first;
// scratch[h] for head h). Writes out[task_heads][group, dim] and lse[task_heads][group].
template <typename W, int64_t CHUNKS>
void attend(const float* q, const float* k_pool, const float* v_pool, int64_t slot_stride, const int32_t* slots, int64_t begin,
            int64_t end, int64_t task_heads, int64_t group, float scale, Scratch<W>* scratch, float* out, float* lse) {
  constexpr int64_t DIM = 32 * CHUNKS, HEADS = heads<W>(), STATE = Scratch<W>::STATE;
  const int64_t vectors = Scratch<W>::vectors(group);
  for (int64_t h = 0; h < task_heads; ++h) {
    Scratch<W>& s = scratch[h];
    for (int64_t w = 0; w < vectors; ++w) {
      pack_queries<W>(q + h * group * DIM, DIM, w * HEADS, group, s.q4.data() + w * DIM / 4 * W::N);
      reset_state<W>(s.state.data() + w * STATE);
    }
    std::fill(s.acc.begin(), s.acc.begin() + group * DIM, 0.f);
  }
  auto score = [&](int64_t h, const float* const* keys, int64_t n) {
    Scratch<W>& s = scratch[h];
    for (int64_t w = 0; w < vectors; ++w) {
      const float* q4 = s.q4.data() + w * DIM / 4 * W::N;
      float* probs = s.probs.data() + w * VECS * W::N;
      score_block<W>([&](int64_t t) { return quad_partials<W, CHUNKS>(q4, keys[t]); }, n, [&](int64_t) { return W::set1(scale); },
                     [&](int64_t j, typename W::Reg p) { W::store(probs + W::N * j, p); }, s.state.data() + w * STATE);
    }
  };
  auto accumulate = [&](int64_t h, const float* const* values, int64_t n) {
    Scratch<W>& s = scratch[h];
    for (int64_t g = 0; g < group; ++g) {
      const int64_t w = g / HEADS, lane = 4 * (g % HEADS);
      accumulate_values<W, CHUNKS>(s.probs.data() + w * VECS * W::N + lane, s.state[w * STATE + 2 * W::N + lane], values, n,
                                   s.acc.data() + g * DIM);
    }
  };
  for_each_block(k_pool, v_pool, slot_stride, slots, begin, end, DIM, task_heads, score, accumulate);
  for (int64_t h = 0; h < task_heads; ++h)
    finish<W>(scratch[h].acc.data(), scratch[h].state.data(), group, DIM, out + h * group * DIM, lse + h * group);
}

}  // namespace f32
#endif

#ifdef ACTORSERVE_LANES8
// int8 pools on CPUs with AVX2 and no AVX512-VNNI. Q.K: each query head is rounded to int8 against
// its own scale (as the VNNI path does), and vpmaddubsw multiplies a key's bytes by the query's
// (|k| times q with k's sign: both within 127, so a pair's sum cannot saturate 16 bits), vpmaddwd
// sums each four in int32 (exact). A key's 16-byte pieces are broadcast to both 128-bit lanes, one
// query head each, which leaves partial sums in the quad layout (lane 4h + i: elements 16c + 4i ..
// 16c + 4i + 3); the score is that integer times the query's scale and the key row's. P.V: each
// probability times its value row's scale weights the row converted to float32, as f32's.
namespace i8x8 {

using namespace quad;
using W = Lanes8;
constexpr int64_t HEADS = heads<W>();

// Scratch of one thread for `attend` (sizes for the largest group and dim).
struct Scratch {
  static constexpr int64_t STATE = 3 * W::N;  // per vector of heads: running max, running sum, this block's rescale
  std::vector<int8_t> q2;  // [vectors][dim / 16][32]: 128-bit lane h of vector c holds q[h][16c .. 16c + 15]
  std::vector<float> q_scale;  // [vectors][8]: lane 4h + i the head's query scale times the attention's
  std::vector<float> probs;  // [vectors][VECS][8] probabilities times their value rows' scales
  std::vector<float> state;  // [vectors][STATE]
  std::vector<float> acc;  // [group][dim]
  std::vector<float> q;  // [group][dim] the queries as float
  float key_scale[BLOCK], value_scale[BLOCK];
  Scratch(int64_t group, int64_t dim)
      : q2(vectors(group) * dim * 2), q_scale(vectors(group) * W::N), probs(vectors(group) * VECS * W::N), state(vectors(group) * STATE),
        acc(group * dim), q(group * dim) {}
  static int64_t vectors(int64_t group) { return (group + HEADS - 1) / HEADS; }
};

// Query heads first and first + 1 (zeros past `group`) as vpmaddubsw operands, with their scales
// (times `scale`), each head rounded as kv_rows.h rounds a row.
inline void pack_queries(const float* q, int64_t dim, int64_t first, int64_t group, float scale, int8_t* q2, float* q_scale) {
  for (int64_t h = 0; h < HEADS; ++h) {
    const int64_t head = first + h;
    int8_t row[actorserve::MAX_HEAD_DIM + actorserve::kRowScaleBytes] = {};
    if (head < group) actorserve::quantize_kv_row(q + head * dim, dim, row);
    const float s = head < group ? actorserve::row_scale(row, dim) : 0.f;
    for (int64_t i = 0; i < 4; ++i) q_scale[4 * h + i] = s * scale;
    for (int64_t c = 0; c < dim / 16; ++c) std::memcpy(q2 + 32 * c + 16 * h, row + 16 * c, 16);
  }
}

// Two heads' partial sums against one key row: lane 4h + i sums the products of elements
// 16c + 4i .. 16c + 4i + 3 over the row's pieces c.
template <int64_t CHUNKS>
inline __m256 pair_partials(const int8_t* q2, const int8_t* key) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto piece = [&](int64_t c) {
    const __m256i k = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key + 16 * c)));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q2 + 32 * c));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(k), _mm256_sign_epi8(q, k)), ones);
  };
  __m256i sum = piece(0);
  for (int64_t c = 1; c < 2 * CHUNKS; ++c) sum = _mm256_add_epi32(sum, piece(c));
  return _mm256_cvtepi32_ps(sum);  // exact: below 2^24
}

// Query heads whose accumulators P.V keeps in registers at once.
constexpr int PV_HEADS = 4;

// 8-float vectors of a row that P.V takes at once for G heads (a power of 2, at most the row's V):
// G accumulators each, the G heads' probabilities and one row vector in 14 of AVX2's 16 registers
// (with all 16 so planned, GCC kept one accumulator on the stack, a store and a load every key).
template <int64_t G, int64_t V>
constexpr int64_t pv_slice() {
  int64_t s = 1;
  while (2 * s <= V && G * 2 * s + G + 1 <= 14) s *= 2;
  return s;
}

// acc = acc * rescale + P.V over the block's first n value rows for the G query heads from `first`
// on (their probabilities, already times the rows' scales, and rescales in s). Each int8 row is
// converted to float once, in slices of the row, and weighs in for every head of the pass: a
// widened copy of the block read again head by head cost loads and stores that outnumbered the
// FMAs. Each accumulator takes its keys in order, one FMA each, as that copy's per-head pass did:
// the same bits.
template <int64_t CHUNKS, int64_t G>
inline void accumulate_heads(Scratch& s, int64_t first, const int8_t* const* rows, int64_t n) {
  constexpr int64_t DIM = 32 * CHUNKS, V = DIM / W::N, S = pv_slice<G, V>(), STATE = Scratch::STATE;
  const float* p[G];
  float rescale[G];
  for (int64_t g = 0; g < G; ++g) {
    const int64_t w = (first + g) / HEADS, lane = 4 * ((first + g) % HEADS);
    p[g] = s.probs.data() + w * VECS * W::N + lane;
    rescale[g] = s.state[w * STATE + 2 * W::N + lane];
  }
  for (int64_t col = 0; col < V; col += S) {
    __m256 a[G][S];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t v = 0; v < S; ++v) a[g][v] = W::mul(W::load(s.acc.data() + (first + g) * DIM + W::N * (col + v)), W::set1(rescale[g]));
    for (int64_t t = 0; t < n; ++t) {
      const int64_t at = W::N * (t / 4) + t % 4;
      for (int64_t v = 0; v < S; ++v) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[t] + W::N * (col + v)));
        const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        for (int64_t g = 0; g < G; ++g) a[g][v] = W::fmadd(W::set1(p[g][at]), x, a[g][v]);
      }
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t v = 0; v < S; ++v) W::store(s.acc.data() + (first + g) * DIM + W::N * (col + v), a[g][v]);
  }
}

// Attention of `group` query heads per K/V head (q: [task_heads][group, 32 * CHUNKS], unscaled) over
// keys `begin` to `end` of one request, for `task_heads` K/V heads (the int8 pools offset to the first;
// scratch[h] for head h). Writes out[task_heads][group, dim] and lse[task_heads][group].
template <typename T, int64_t CHUNKS>
void attend(const T* q, const int8_t* k_pool, const int8_t* v_pool, int64_t slot_stride, const int32_t* slots, int64_t begin,
            int64_t end, int64_t task_heads, int64_t group, float scale, Scratch* scratch, float* out, float* lse) {
  constexpr int64_t DIM = 32 * CHUNKS, STATE = Scratch::STATE;
  const int64_t vectors = Scratch::vectors(group);
  for (int64_t h = 0; h < task_heads; ++h) {
    Scratch& s = scratch[h];
    load_row(q + h * group * DIM, s.q.data(), group * DIM);
    for (int64_t w = 0; w < vectors; ++w) {
      pack_queries(s.q.data(), DIM, w * HEADS, group, scale, s.q2.data() + w * DIM * 2, s.q_scale.data() + W::N * w);
      reset_state<W>(s.state.data() + w * STATE);
    }
    std::fill(s.acc.begin(), s.acc.begin() + group * DIM, 0.f);
  }
  auto score = [&](int64_t h, const int8_t* const* keys, int64_t n) {
    Scratch& s = scratch[h];
    for (int64_t t = 0; t < BLOCK; ++t) s.key_scale[t] = actorserve::row_scale(keys[t], DIM);
    for (int64_t w = 0; w < vectors; ++w) {
      const int8_t* q2 = s.q2.data() + w * DIM * 2;
      const __m256 q_scale = W::load(s.q_scale.data() + W::N * w);
      float* probs = s.probs.data() + w * VECS * W::N;
      score_block<W>([&](int64_t t) { return pair_partials<CHUNKS>(q2, keys[t]); }, n,
                     [&](int64_t j) { return W::mul(q_scale, W::broadcast4(s.key_scale + QUAD_KEYS * j)); },
                     [&](int64_t j, __m256 p) { W::store(probs + W::N * j, p); }, s.state.data() + w * STATE);
    }
  };
  auto accumulate = [&](int64_t h, const int8_t* const* values, int64_t n) {
    Scratch& s = scratch[h];
    for (int64_t t = 0; t < BLOCK; ++t) s.value_scale[t] = actorserve::row_scale(values[t], DIM);
    scale_by_rows<W>(s.probs.data(), vectors, s.value_scale);
    for_each_head_pass<PV_HEADS>(
        group, [&](auto count, int64_t first) { accumulate_heads<CHUNKS, decltype(count)::value>(s, first, values, n); });
  };
  for_each_block(k_pool, v_pool, slot_stride, slots, begin, end, DIM, task_heads, score, accumulate);
  for (int64_t h = 0; h < task_heads; ++h)
    finish<W>(scratch[h].acc.data(), scratch[h].state.data(), group, DIM, out + h * group * DIM, lse + h * group);
}

}  // namespace i8x8
#endif

#ifdef ACTORSERVE_INT8_DOT
// int8 pools (kv_rows.h) on CPUs with AVX512-VNNI. Q.K: each query head is rounded to int8 against
// its own scale, and vpdpbusd multiplies four key bytes by four query bytes and sums them in int32
// (exact), so each instruction advances four heads by 16 elements of a key broadcast to every
// quarter; vpdpbusd takes its first operand unsigned, so the keys go in as k + 128 (a sign-bit
// flip) and 128 times the query's sum comes off again. The score is then that integer times the
// query's scale and the key row's. P.V: each probability times its value row's scale weights the
// row converted to float32, with every head of a pass sharing the conversion.
namespace i8 {

using namespace quad;
using W = Lanes16;
constexpr int64_t HEADS = heads<W>();

// Scratch of one thread for `attend` (sizes for the largest group and dim).
struct Scratch {
  std::vector<int8_t> q4;  // [quads][dim / 16][64]: lane 4h + i of vector c holds q[h][16c + 4i .. 16c + 4i + 3]
  std::vector<float> q_scale;  // [quads][16]: lane 4h + i the head's query scale times the attention's
  std::vector<float> q_offset;  // [quads][16]: lane 4h + i 32 times the head's int8 query sum (a quarter of the +128's share)
  std::vector<float> probs;  // [quads][VECS][16] probabilities times their value rows' scales
  std::vector<float> state;  // [quads][3][16]: running max, running sum, this block's rescale
  std::vector<float> acc;  // [group][dim]
  std::vector<float> q;  // [group][dim] the queries as float
  float key_scale[BLOCK], value_scale[BLOCK];
  Scratch(int64_t group, int64_t dim)
      : q4(quads(group) * dim * 4), q_scale(quads(group) * 16), q_offset(quads(group) * 16), probs(quads(group) * VECS * 16),
        state(quads(group) * 48), acc(group * dim), q(group * dim) {}
  static int64_t quads(int64_t group) { return (group + HEADS - 1) / HEADS; }
};

// Query heads first .. first + 3 (zeros past `group`) as vpdpbusd operands, with their scales
// (times `scale`) and offsets, each head rounded as kv_rows.h rounds a row.
inline void pack_queries(const float* q, int64_t dim, int64_t first, int64_t group, float scale, int8_t* q4, float* q_scale, float* q_offset) {
  for (int64_t h = 0; h < HEADS; ++h) {
    const int64_t head = first + h;
    int8_t row[actorserve::MAX_HEAD_DIM + actorserve::kRowScaleBytes] = {};
    if (head < group) actorserve::quantize_kv_row(q + head * dim, dim, row);
    int32_t sum = 0;
    for (int64_t d = 0; d < dim; ++d) sum += row[d];
    const float s = head < group ? actorserve::row_scale(row, dim) : 0.f;
    for (int64_t i = 0; i < 4; ++i) {
      q_scale[4 * h + i] = s * scale;
      q_offset[4 * h + i] = 32.f * static_cast<float>(sum);
    }
    for (int64_t c = 0; c < dim / 16; ++c)
      for (int64_t i = 0; i < 4; ++i) std::memcpy(q4 + 64 * c + 16 * h + 4 * i, row + 16 * c + 4 * i, 4);
  }
}

// Four heads' partial sums against one key row, less their offsets: lane 4h + i sums the products
// of elements 16c + 4i .. 16c + 4i + 3 over the row's pieces c.
template <int64_t CHUNKS>
inline __m512 quad_partials(const int8_t* q4, const __m512 q_offset, const int8_t* key) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  auto piece = [&](int64_t c) {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(key + 16 * c))), flip);
  };
  __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();  // two chains: half the latency
  for (int64_t c = 0; c < 2 * CHUNKS; c += 2) {
    even = _mm512_dpbusd_epi32(even, piece(c), _mm512_loadu_si512(q4 + 64 * c));
    odd = _mm512_dpbusd_epi32(odd, piece(c + 1), _mm512_loadu_si512(q4 + 64 * (c + 1)));
  }
  return _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even, odd)), q_offset);  // exact: below 2^24
}

// acc = acc * rescale + P.V over the block's first n value rows for the H heads of one pass: head
// h's probabilities at p[h][16 * (t / 4) + t % 4] (already times the value scales).
template <int64_t CHUNKS, int H>
inline void accumulate_values(const float* const* p, const float* rescale, const int8_t* const* rows, int64_t n, float* const* acc) {
  constexpr int64_t V = 2 * CHUNKS;  // 16-float vectors per row
  __m512 a[H][V];
  for (int h = 0; h < H; ++h) {
    const __m512 r = _mm512_set1_ps(rescale[h]);
    for (int64_t v = 0; v < V; ++v) a[h][v] = _mm512_mul_ps(_mm512_loadu_ps(acc[h] + 16 * v), r);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 x[V];
    for (int64_t v = 0; v < V; ++v)
      x[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[t] + 16 * v))));
    const int64_t at = 16 * (t / 4) + t % 4;
    for (int h = 0; h < H; ++h) {
      const __m512 w = _mm512_set1_ps(p[h][at]);
      for (int64_t v = 0; v < V; ++v) a[h][v] = _mm512_fmadd_ps(w, x[v], a[h][v]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(acc[h] + 16 * v, a[h][v]);
}

// Attention of `group` query heads per K/V head (q: [task_heads][group, 32 * CHUNKS], unscaled) over
// keys `begin` to `end` of one request, for `task_heads` K/V heads (the int8 pools offset to the first;
// scratch[h] for head h). Writes out[task_heads][group, dim] and lse[task_heads][group].
template <typename T, int64_t CHUNKS>
void attend(const T* q, const int8_t* k_pool, const int8_t* v_pool, int64_t slot_stride, const int32_t* slots, int64_t begin,
            int64_t end, int64_t task_heads, int64_t group, float scale, Scratch* scratch, float* out, float* lse) {
  constexpr int64_t DIM = 32 * CHUNKS;
  constexpr int PASS = heads_per_pass<CHUNKS>();
  const int64_t quads = Scratch::quads(group);
  for (int64_t h = 0; h < task_heads; ++h) {
    Scratch& s = scratch[h];
    load_row(q + h * group * DIM, s.q.data(), group * DIM);
    for (int64_t w = 0; w < quads; ++w) {
      pack_queries(s.q.data(), DIM, w * HEADS, group, scale, s.q4.data() + w * DIM * 4, s.q_scale.data() + 16 * w,
                   s.q_offset.data() + 16 * w);
      reset_state<W>(s.state.data() + w * 48);
    }
    std::fill(s.acc.begin(), s.acc.begin() + group * DIM, 0.f);
  }
  auto score = [&](int64_t head, const int8_t* const* keys, int64_t n) {
    Scratch& s = scratch[head];
    for (int64_t t = 0; t < BLOCK; ++t) s.key_scale[t] = actorserve::row_scale(keys[t], DIM);
    for (int64_t w = 0; w < quads; ++w) {
      const int8_t* q4 = s.q4.data() + w * DIM * 4;
      const __m512 offset = W::load(s.q_offset.data() + 16 * w), q_scale = W::load(s.q_scale.data() + 16 * w);
      float* probs = s.probs.data() + w * VECS * 16;
      score_block<W>([&](int64_t t) { return quad_partials<CHUNKS>(q4, offset, keys[t]); }, n,
                     [&](int64_t j) { return W::mul(q_scale, W::broadcast4(s.key_scale + QUAD_KEYS * j)); },
                     [&](int64_t j, __m512 p) { W::store(probs + 16 * j, p); }, s.state.data() + w * 48);
    }
  };
  auto accumulate = [&](int64_t head, const int8_t* const* values, int64_t n) {
    Scratch& s = scratch[head];
    for (int64_t t = 0; t < BLOCK; ++t) s.value_scale[t] = actorserve::row_scale(values[t], DIM);
    scale_by_rows<W>(s.probs.data(), quads, s.value_scale);
    for_each_head_pass<PASS>(group, [&](auto count, int64_t first) {
      constexpr int H = decltype(count)::value;
      const float* p[H];
      float rescale[H];
      float* acc[H];
      for (int h = 0; h < H; ++h) {
        const int64_t g = first + h, w = g / HEADS, lane = 4 * (g % HEADS);
        p[h] = s.probs.data() + w * VECS * 16 + lane;
        rescale[h] = s.state[w * 48 + 32 + lane];
        acc[h] = s.acc.data() + g * DIM;
      }
      accumulate_values<CHUNKS, H>(p, rescale, values, n, acc);
    });
  };
  for_each_block(k_pool, v_pool, slot_stride, slots, begin, end, DIM, task_heads, score, accumulate);
  for (int64_t h = 0; h < task_heads; ++h)
    finish<W>(scratch[h].acc.data(), scratch[h].state.data(), group, DIM, out + h * group * DIM, lse + h * group);
}

}  // namespace i8
#endif

// The head sizes the vector paths unroll: 32 * CHUNKS.
inline bool unrolled_dim(int64_t dim) { return dim == 32 || dim == 64 || dim == 128; }

// call(std::integral_constant<int64_t, CHUNKS>) for an unrolled `dim`.
template <typename Call>
void with_chunks(int64_t dim, Call call) {
  if (dim == 32) call(std::integral_constant<int64_t, 1>{});
  else if (dim == 64) call(std::integral_constant<int64_t, 2>{});
  else call(std::integral_constant<int64_t, 4>{});
}

// Which kernel attends a task: the generic one, or a vector path for float32 rows (256- or 512-bit
// lanes), bfloat16 rows (AVX512-BF16) or int8 rows (AVX512-VNNI, else AVX2), for head sizes it unrolls.
enum class Path { kGeneric, kF32Lanes8, kF32Lanes16, kBf16, kInt8, kInt8Lanes8 };

// Vector widths in bits of the float32 paths compiled here, widest first, then 0: the generic path.
// Built once: every decode call reads it.
const std::vector<int64_t>& compiled_widths() {
  static const std::vector<int64_t> widths = {
#ifdef ACTORSERVE_F32_LANES16
      512,
#endif
#ifdef ACTORSERVE_LANES8
      256,
#endif
      0};
  return widths;
}

std::vector<int64_t> widths() { return compiled_widths(); }

// The path for P rows of `dim` elements (T queries) with vectors of at most `width` bits.
template <typename T, typename P>
Path choose_path(int64_t dim, int64_t width) {
  if (!unrolled_dim(dim)) return Path::kGeneric;
#ifdef ACTORSERVE_INT8_DOT
  if (std::is_same_v<P, int8_t> && width >= 512) return Path::kInt8;
#endif
#ifdef ACTORSERVE_LANES8
  if (std::is_same_v<P, int8_t> && width >= 256) return Path::kInt8Lanes8;
#endif
#ifdef ACTORSERVE_BF16_DOT
  if (std::is_same_v<T, c10::BFloat16> && std::is_same_v<P, T> && width >= 512) return Path::kBf16;
#endif
  if (!std::is_same_v<T, float> || !std::is_same_v<P, float>) return Path::kGeneric;
#ifdef ACTORSERVE_F32_LANES16
  if (width >= 512) return Path::kF32Lanes16;
#endif
#ifdef ACTORSERVE_LANES8
  if (width >= 256) return Path::kF32Lanes8;
#endif
  return Path::kGeneric;
}

// K/V heads per task: as many as keep a slot's rows of them within MAX_TASK_SPAN bytes (a block's
// rows of one pool then take at most 32 KiB, a typical L1), when there are enough requests to keep
// every thread busy; else one, so that a small batch still spreads over the threads. `requested`
// > 0 overrides (tests).
constexpr int64_t MAX_TASK_SPAN = 1024;

int64_t heads_per_task(int64_t batch, int64_t kv_heads, int64_t row_bytes, int64_t threads, int64_t requested) {
  if (requested > 0) return std::min(requested, kv_heads);
  if (batch < 4 * threads) return 1;
  const int64_t most = std::clamp<int64_t>(MAX_TASK_SPAN / row_bytes, 1, kv_heads);
  const int64_t tasks = (kv_heads + most - 1) / most;
  return (kv_heads + tasks - 1) / tasks;  // the same count in every task where it divides
}

// One Scratch per head of a task where `path` is `wanted`, else none.
template <typename S>
std::vector<S> scratch_for(Path path, Path wanted, int64_t heads, int64_t group, int64_t dim) {
  return path == wanted ? std::vector<S>(heads, S(group, dim)) : std::vector<S>();
}

template <typename T, typename P>
void run(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& req_to_token,
         const at::Tensor& req_rows, const at::Tensor& key_begin, const at::Tensor& key_end, double scale, int64_t width,
         int64_t requested_heads, at::Tensor& out, at::Tensor& lse) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_pool.size(1), group = heads / kv_heads;
  const T* q_data = q.data_ptr<T>();
  const int64_t q_stride = q.stride(0);
  const P* k_data = static_cast<const P*>(k_pool.const_data_ptr());
  const P* v_data = static_cast<const P*>(v_pool.const_data_ptr());
  const int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t table_stride = req_to_token.stride(0);
  const int64_t* rows = req_rows.data_ptr<int64_t>();
  const int64_t* begins = key_begin.data_ptr<int64_t>();
  const int64_t* ends = key_end.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  float* lse_data = lse.data_ptr<float>();
  const int64_t row = row_elems<P>(dim), slot_stride = kv_heads * row;
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t per_task = heads_per_task(batch, kv_heads, row * static_cast<int64_t>(sizeof(P)), threads, requested_heads);
  const int64_t tasks_per_request = (kv_heads + per_task - 1) / per_task, num_tasks = batch * tasks_per_request;
  const Path path = choose_path<T, P>(dim, width);
  // Dynamic scheduling: contexts differ, and with them the cost of each task.
#pragma omp parallel num_threads(static_cast<int>(std::max<int64_t>(1, std::min(threads, num_tasks))))
  {
    std::vector<float> qf(group * dim), acc(group * dim), rows_buf(BLOCK * dim), scores(group * BLOCK), result(per_task * group * dim);
#ifdef ACTORSERVE_BF16_DOT
    auto bf16_scratch = scratch_for<bf16::Scratch>(path, Path::kBf16, per_task, group, dim);
#endif
#ifdef ACTORSERVE_F32_LANES16
    auto f32x16_scratch = scratch_for<f32::Scratch<Lanes16>>(path, Path::kF32Lanes16, per_task, group, dim);
#endif
#ifdef ACTORSERVE_LANES8
    auto f32x8_scratch = scratch_for<f32::Scratch<Lanes8>>(path, Path::kF32Lanes8, per_task, group, dim);
#endif
#ifdef ACTORSERVE_INT8_DOT
    auto i8_scratch = scratch_for<i8::Scratch>(path, Path::kInt8, per_task, group, dim);
#endif
#ifdef ACTORSERVE_LANES8
    auto i8x8_scratch = scratch_for<i8x8::Scratch>(path, Path::kInt8Lanes8, per_task, group, dim);
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t b = task / tasks_per_request, first = (task % tasks_per_request) * per_task;
      const int64_t count = std::min(per_task, kv_heads - first);
      const T* q_head = q_data + b * q_stride + first * group * dim;
      const P* k_head = k_data + first * row;
      const P* v_head = v_data + first * row;
      const int32_t* slots = table + rows[b] * table_stride;
      float* lse_out = lse_data + b * heads + first * group;
      // for_each_block fetches each block's successor; a task's first block would come cold. Tasks
      // cost about the same, so a thread's next one is likely `threads` on: fetch its first block.
      if (task + threads < num_tasks) {
        const int64_t next_b = (task + threads) / tasks_per_request, next_first = ((task + threads) % tasks_per_request) * per_task;
        prefetch_first_block(k_data + next_first * row, v_data + next_first * row, slot_stride, table + rows[next_b] * table_stride,
                             begins[next_b], ends[next_b], std::min(per_task, kv_heads - next_first) * row);
      }
#ifdef ACTORSERVE_QUAD_SCORES
      auto attend_f32 = [&](auto& scratch) {
        using W = typename std::remove_reference_t<decltype(scratch[0])>::Lanes;
        if constexpr (std::is_same_v<T, float> && std::is_same_v<P, float>) {  // the only pair choose_path gives these paths
          with_chunks(dim, [&](auto chunks) {
            f32::attend<W, decltype(chunks)::value>(q_head, k_head, v_head, slot_stride, slots, begins[b], ends[b], count, group,
                                                    static_cast<float>(scale), scratch.data(), result.data(), lse_out);
          });
        }
      };
#endif
      if (path == Path::kInt8) {
#ifdef ACTORSERVE_INT8_DOT
        with_chunks(dim, [&](auto chunks) {
          i8::attend<T, decltype(chunks)::value>(q_head, reinterpret_cast<const int8_t*>(k_head), reinterpret_cast<const int8_t*>(v_head),
                                                 slot_stride, slots, begins[b], ends[b], count, group, static_cast<float>(scale),
                                                 i8_scratch.data(), result.data(), lse_out);
        });
#endif
      } else if (path == Path::kInt8Lanes8) {
#ifdef ACTORSERVE_LANES8
        with_chunks(dim, [&](auto chunks) {
          i8x8::attend<T, decltype(chunks)::value>(q_head, reinterpret_cast<const int8_t*>(k_head), reinterpret_cast<const int8_t*>(v_head),
                                                   slot_stride, slots, begins[b], ends[b], count, group, static_cast<float>(scale),
                                                   i8x8_scratch.data(), result.data(), lse_out);
        });
#endif
      } else if (path == Path::kBf16) {
#ifdef ACTORSERVE_BF16_DOT
        with_chunks(dim, [&](auto chunks) {
          bf16::attend<decltype(chunks)::value>(reinterpret_cast<const uint16_t*>(q_head), reinterpret_cast<const uint16_t*>(k_head),
                                                reinterpret_cast<const uint16_t*>(v_head), slot_stride, slots, begins[b], ends[b], count,
                                                group, static_cast<float>(scale), bf16_scratch.data(), result.data(), lse_out);
        });
#endif
      } else if (path == Path::kF32Lanes16) {
#ifdef ACTORSERVE_F32_LANES16
        attend_f32(f32x16_scratch);
#endif
      } else if (path == Path::kF32Lanes8) {
#ifdef ACTORSERVE_LANES8
        attend_f32(f32x8_scratch);
#endif
      } else {
        for (int64_t h = 0; h < count; ++h) {
          const T* qh = q_head + h * group * dim;
          for (int64_t i = 0; i < group * dim; ++i) qf[i] = actorserve::load_f32(qh + i) * static_cast<float>(scale);
          auto call = [&](auto fixed_dim) {
            attend<P, decltype(fixed_dim)::value>(qf.data(), k_head + h * row, v_head + h * row, slot_stride, slots, begins[b], ends[b],
                                                   group, dim, acc.data(), rows_buf.data(), scores.data(), result.data() + h * group * dim,
                                                   lse_out + h * group);
          };
          if (dim == 32) call(std::integral_constant<int64_t, 32>{});
          else if (dim == 64) call(std::integral_constant<int64_t, 64>{});
          else if (dim == 128) call(std::integral_constant<int64_t, 128>{});
          else call(std::integral_constant<int64_t, 0>{});
        }
      }
      T* o = out_data + (b * heads + first * group) * dim;
      for (int64_t i = 0; i < count * group * dim; ++i) actorserve::store_f32(o + i, result[i]);
    }
  }
}

// q: [batch, heads, dim]; k_pool, v_pool: [slots, kv_heads, dim] in q's dtype, or int8 rows (kv_rows.h);
// req_to_token: [rows, context] int32; req_rows, key_begin, key_end: [batch] int64 (request b
// attends to the slots at positions key_begin[b] .. key_end[b] - 1 of its row, at least one).
// Returns out [batch, heads, dim] in q's dtype and lse [batch, heads] float32. width: the widest
// vectors in bits a path may use (one of `widths()`: the benchmark and the tests compare paths);
// task_heads: K/V heads per task, 0 to choose by the batch (heads_per_task; the tests vary it).
std::tuple<at::Tensor, at::Tensor> decode_attention_at(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                                       const at::Tensor& req_to_token, const at::Tensor& req_rows,
                                                       const at::Tensor& key_begin, const at::Tensor& key_end, double scale,
                                                       int64_t width, int64_t task_heads) {
  const auto& compiled = compiled_widths();
  TORCH_CHECK(std::find(compiled.begin(), compiled.end(), width) != compiled.end(), "vector width ", width,
              " is not compiled here (see decode_attention_widths)");
  TORCH_CHECK(task_heads >= 0, "task_heads must be 0 (chosen by the batch) or a count of K/V heads, got ", task_heads);
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
  auto out = at::empty(q.sizes(), q.options());  // contiguous even when q is a strided view
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  actorserve::dispatch_q_and_pool(q, k_pool, [&](auto t, auto p) {
    run<decltype(t), decltype(p)>(q, k_pool, v_pool, req_to_token, req_rows, key_begin, key_end, scale, width, task_heads, out, lse);
  });
  return {out, lse};
}

// decode_attention_at with the widest vectors compiled.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                                    const at::Tensor& req_to_token, const at::Tensor& req_rows,
                                                    const at::Tensor& key_begin, const at::Tensor& key_end, double scale) {
  return decode_attention_at(q, k_pool, v_pool, req_to_token, req_rows, key_begin, key_end, scale, compiled_widths().front(), 0);
}

}  // namespace

TORCH_LIBRARY(actorserve, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor req_to_token, Tensor req_rows, Tensor key_begin, Tensor key_end, float scale) -> (Tensor, Tensor)");
  m.def("decode_attention_at(Tensor q, Tensor k_pool, Tensor v_pool, Tensor req_to_token, Tensor req_rows, Tensor key_begin, Tensor key_end, float scale, int width, int heads_per_task=0) -> (Tensor, Tensor)");
  m.def("decode_attention_widths() -> int[]", &widths);
}

TORCH_LIBRARY_IMPL(actorserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_at", &decode_attention_at);
}
