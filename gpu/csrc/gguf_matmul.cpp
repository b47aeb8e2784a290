// Linear layers on GGUF's block-quantized weights as they are stored (Q4_0, Q4_1, Q4_K, Q5_*, Q8_0),
// on a CPU with AVX512-VNNI or AVX2: y = x W^T with W never widened past 4 or 8 bits.
//
// A GGUF block is 32 consecutive weights of one output row with a scale d and, in effect, a
// minimum m: w = d * u + m, u unsigned (Q4_1: u in 0..15 as stored; Q4_0: u = q, m = -8d;
// Q8_0: u = q + 128, m = -128d). `Bits` is how many bits u takes: 4 (held two to a byte), 5 (Q5_*:
// a byte each) or 8 (a byte each). gpu/gguf_linear.py repacks them once: 64 output rows per weight
// block, four inputs per 32-bit lane so that one 64-byte load feeds one `vpdpbusd` (16 rows x 4
// products); 4-bit weights keep two inputs per byte (the low nibble from one group of four inputs,
// the high from the next), which halves what a decode step reads. Activations are quantized per
// row and per 32-input block, as llama.cpp's Q8 activations are: q = round(x / a), a = max|x|/127,
// and the block's sum s = a * sum(q). Per block and output row the integer dot product of u and q
// then gives d * a * dot + m * s, accumulated in float32.
//
// The result is the dot product of the dequantized weights with the dequantized activations, up to
// float32 rounding (tests/test_gguf_linear.py against float64). CPUs with AVX2 but not AVX512-VNNI
// take a 256-bit path (`vpmaddubsw`); `gguf_matmul_widths()` lists the paths compiled, and where
// there is none gpu/gguf_linear.py runs the same arithmetic as torch ops.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "linear_bias.h"
#include "half_blocks.h"
#include "parallel.h"
#include "thread_buffer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ACTORSERVE_GGUF_VNNI 1
#include "store_lanes.h"
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ACTORSERVE_GGUF_AVX2 1
#include <immintrin.h>
#endif
#if defined(ACTORSERVE_GGUF_VNNI) || defined(ACTORSERVE_GGUF_AVX2)
#define ACTORSERVE_GGUF_KERNEL 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 64;  // output rows per weight block: four 16-lane (VNNI) or eight 8-lane (AVX2) vectors
constexpr int64_t kGroup = 32;  // inputs per GGUF block (one scale and minimum per row)

// Bits of a weight's byte layout: 4-bit weights two to a byte, wider ones a byte each.
template <int Bits>
constexpr int kStoredBits = Bits == 4 ? 4 : 8;

// Vector widths in bits of the paths compiled here, widest first: 512 (AVX512-VNNI), 256 (AVX2).
// Built once: every linear layer's call reads it.
const std::vector<int64_t>& compiled_widths() {
  static const std::vector<int64_t> widths = {
#ifdef ACTORSERVE_GGUF_VNNI
      512,
#endif
#ifdef ACTORSERVE_GGUF_AVX2
      256,
#endif
  };
  return widths;
}

std::vector<int64_t> widths() { return compiled_widths(); }

bool gguf_matmul_available() { return !compiled_widths().empty(); }

#ifdef ACTORSERVE_GGUF_KERNEL

// Eight activations as float32.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const double* x) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(_mm256_loadu_pd(x))), _mm256_cvtpd_ps(_mm256_loadu_pd(x + 4)), 1);
}
inline __m256 load8(const c10::Half* x) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }
inline __m256 load8(const c10::BFloat16* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

// One row's activations, per 32-input block: q = round_half_even(x / a) with a = max|x| / 127
// (0 for an all-zero block, whose q are then 0), and s = a * sum(q). In 256-bit vectors, which
// every CPU with either path has: a scalar division per input cost a 64-row decode step ~3 ms.
template <typename T>
void quantize_blocks(const T* x, int64_t dim, int8_t* q, float* a, float* s) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < dim / kGroup; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b * kGroup + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.f;
    __m256i n[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 ratio = scale > 0.f ? _mm256_div_ps(v[i], _mm256_set1_ps(scale)) : _mm256_setzero_ps();
      n[i] = _mm256_cvtps_epi32(_mm256_round_ps(ratio, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // int32 -> int8 (|n| <= 127, no saturation); the packs interleave 128-bit lanes, the permute undoes it.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kGroup), _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    a[b] = scale;
    s[b] = scale * static_cast<float>(_mm_cvtsi128_si32(t4));
  }
}

struct Activations {
  const int8_t* q;
  const float* a;
  const float* s;
  int64_t dim;  // of q; a and s hold dim / 32 per row
};

struct WeightBlock {
  const uint8_t* u;   // the 64 rows' weights, in the layout of `kStoredBits<Bits>`
  const uint16_t* d;  // float16 [dim / 32][64]
  const uint16_t* m;  // float16 [dim / 32][64]
  const float* bias;  // the block's first output, or nullptr
  int64_t count;      // outputs of the block that exist (the last block may be short)
};

inline int32_t four_bytes(const int8_t* q) {
  int32_t four;
  std::memcpy(&four, q, sizeof four);
  return four;
}
#endif

#ifdef ACTORSERVE_GGUF_VNNI
// 16 outputs per vector. Few rows (a decode step of a few requests reads its weights from memory):
// whole 64-row weight blocks, up to two activation rows a pass. From kHalfBlockRows rows on the
// work is compute-bound: half blocks (32 outputs) with five rows a pass, so each unpacked weight
// vector feeds five rows' `vpdpbusd`s, and twice as many work items share the threads (a layer of
// 576 outputs is 9 blocks: 5 and 4 on two threads, but 9 and 9 halves).
namespace vnni {

using actorserve::store16;
constexpr int kBlockRows = 2;       // rows a pass over a whole block: 2 x 4 integer and float accumulators
constexpr int kHalfRows = 5;        // rows a pass over a half block: 5 x 2 of each, 4 weight vectors
constexpr int64_t kHalfBlockRows = 32;

inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i broadcast4(const int8_t* q) { return _mm512_set1_epi32(four_bytes(q)); }

// R activation rows against vectors T0 .. T0 + V - 1 (16 outputs each) of one 64-row weight block,
// fetching the pass's share of the next block a group of inputs at a time.
template <int Bits, int R, int V, int T0, typename T>
inline void block_rows(const Activations& x, int64_t row, const WeightBlock& w, T* out, int64_t out_stride,
                       const actorserve::NextBlock& fetch) {
  const int64_t groups = x.dim / kGroup, bytes_per_group = kBlock * kGroup * Bits / 8;
  const int8_t* q[R];
  __m512 y[R][V];
  for (int r = 0; r < R; ++r) {
    q[r] = x.q + (row + r) * x.dim;
    for (int t = 0; t < V; ++t) y[r][t] = _mm512_setzero_ps();
  }
  const int64_t fetch_per_group = fetch.per_step(groups);
  for (int64_t g = 0; g < groups; ++g) {
    fetch.step(g, fetch_per_group);
    __m512i acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < V; ++t) acc[r][t] = _mm512_setzero_si512();
    // A row of the layout holds four inputs of the block's 64 outputs: 16 outputs are 64 bytes.
    const uint8_t* u = w.u + g * bytes_per_group + 64 * T0;
    const int8_t* qg[R];
    for (int r = 0; r < R; ++r) qg[r] = q[r] + g * kGroup;
    if constexpr (Bits == 8) {
      for (int i = 0; i < kGroup / 4; ++i) {
        __m512i wv[V];
        for (int t = 0; t < V; ++t) wv[t] = _mm512_loadu_si512(u + i * kBlock * 4 + 64 * t);
        for (int r = 0; r < R; ++r) {
          const __m512i xb = broadcast4(qg[r] + 4 * i);
          for (int t = 0; t < V; ++t) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wv[t], xb);
        }
      }
    } else {
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int p = 0; p < kGroup / 8; ++p) {
        __m512i lo[V], hi[V];
        for (int t = 0; t < V; ++t) {
          const __m512i packed = _mm512_loadu_si512(u + p * kBlock * 4 + 64 * t);
          lo[t] = _mm512_and_si512(packed, low);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i x_lo = broadcast4(qg[r] + 8 * p), x_hi = broadcast4(qg[r] + 8 * p + 4);
          for (int t = 0; t < V; ++t) {
            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], lo[t], x_lo);
            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], hi[t], x_hi);
          }
        }
      }
    }
    for (int t = 0; t < V; ++t) {
      const __m512 d = load_half16(w.d + g * kBlock + 16 * (T0 + t)), m = load_half16(w.m + g * kBlock + 16 * (T0 + t));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row + r) * groups + g;
        const __m512 da = _mm512_mul_ps(d, _mm512_set1_ps(x.a[at]));
        y[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), da, y[r][t]);
        y[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[at]), y[r][t]);
      }
    }
  }
  for (int t = 0; t < V; ++t) {
    const int64_t first = 16 * (T0 + t), count = std::min<int64_t>(16, w.count - first);
    if (count <= 0) break;
    const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1);
    const __m512 bias = w.bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lanes, w.bias + first);
    for (int r = 0; r < R; ++r) store16(out + r * out_stride + first, _mm512_add_ps(y[r][t], bias), count);
  }
}

// Every row of `act` against one whole block (T0 = 0, V = 4) or one half of it (T0 = 0 or 2, V =
// 2), MaxRows rows a pass, written to out (row stride out_stride); `next` (or nullptr): the block
// to prefetch meanwhile, `next_bytes` long.
template <int Bits, int V, int T0, int MaxRows, typename T>
inline void rows_against(const Activations& act, int64_t rows, const WeightBlock& w, T* out, int64_t out_stride, const uint8_t* next,
                         int64_t next_bytes) {
  actorserve::row_passes<MaxRows>(rows, next, next_bytes, [&]<int R>(int64_t r, const actorserve::NextBlock& fetch) {
    block_rows<Bits, R, V, T0>(act, r, w, out + r * out_stride, out_stride, fetch);
  });
}

}  // namespace vnni
#endif

#ifdef ACTORSERVE_GGUF_AVX2
// 8 outputs per vector, one activation row and half a weight block (32 outputs) a pass: AVX2 has 16
// vector registers. `vpmaddubsw` multiplies u8 x s8 into pairs summed as int16, `vpmaddwd` with
// ones sums those into int32. 4-bit weights: a pair is at most 2 * 15 * 127, so a block's 8 pairs
// per lane add up in int16 before one widening; 5-bit: 2 * 31 * 127, 4 pairs (half a block) before
// each widening. 8-bit weights: u up to 255 would overflow a pair, so they go in as u - 128
// (signed), their magnitude as the unsigned operand and their sign moved onto the activations (the
// minimum then gains 128 d).
namespace avx2 {

inline __m256 load_half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i broadcast4(const int8_t* q) { return _mm256_set1_epi32(four_bytes(q)); }

// One 32-input block of one row against 32 outputs (4 vectors of 8): int32 dot products.
template <int Bits>
inline void dot_block(const uint8_t* u, const int8_t* q, __m256i (&dot)[4]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 4) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i pairs[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
#pragma GCC unroll 1  // see widened_rows
    for (int p = 0; p < kGroup / 8; ++p) {
      const __m256i x_lo = broadcast4(q + 8 * p), x_hi = broadcast4(q + 8 * p + 4);
      for (int v = 0; v < 4; ++v) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + p * kBlock * 4 + 32 * v));
        const __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        pairs[v] = _mm256_add_epi16(pairs[v], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi)));
      }
    }
    for (int v = 0; v < 4; ++v) dot[v] = _mm256_madd_epi16(pairs[v], ones);
  } else if constexpr (Bits == 5) {
    for (int v = 0; v < 4; ++v) dot[v] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      __m256i pairs[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int i = 4 * half; i < 4 * half + 4; ++i) {
        const __m256i x = broadcast4(q + 4 * i);
        for (int v = 0; v < 4; ++v) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + i * kBlock * 4 + 32 * v));
          pairs[v] = _mm256_add_epi16(pairs[v], _mm256_maddubs_epi16(w, x));
        }
      }
      for (int v = 0; v < 4; ++v) dot[v] = _mm256_add_epi32(dot[v], _mm256_madd_epi16(pairs[v], ones));
    }
  } else {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int v = 0; v < 4; ++v) dot[v] = _mm256_setzero_si256();
    for (int i = 0; i < kGroup / 4; ++i) {
      const __m256i x = broadcast4(q + 4 * i);
      for (int v = 0; v < 4; ++v) {
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + i * kBlock * 4 + 32 * v)), flip);
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
        dot[v] = _mm256_add_epi32(dot[v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
}

// One 32-input block's scale d and minimum m at 8 outputs from `col`; 8-bit weights enter the
// integer products as u - 128, so their minimum gains 128 d.
template <int Bits>
inline void block_scales(const WeightBlock& w, int64_t g, int64_t col, __m256& d, __m256& m) {
  d = load_half8(w.d + g * kBlock + col);
  m = load_half8(w.m + g * kBlock + col);
  if constexpr (Bits == 8) m = _mm256_fmadd_ps(d, _mm256_set1_ps(128.f), m);
}

// y + dot d a + m s, the float side of one block for 8 outputs, in this order on every path: a
// row's result does not depend on which path computed it.
inline __m256 add_block(__m256 y, __m256i dot, __m256 d, __m256 m, __m256 a, __m256 s) {
  return _mm256_fmadd_ps(m, s, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, a), y));
}

// A row's 32 outputs from `first` (lanes y), with the bias, to out[first ..] (the block's last
// outputs may be fewer).
template <typename T>
inline void store_half(const float* y, const WeightBlock& w, int64_t first, T* out) {
  const int64_t count = std::min<int64_t>(32, w.count - first);
  if constexpr (std::is_same_v<T, float>) {
    // float32 (AVX2's default dtype) 8 lanes a store: a row's 32 single stores, over a batch whose
    // outputs outgrow the caches, kept the store queue full.
    if (count == 32) {
      for (int v = 0; v < 4; ++v) {
        const __m256 lanes = _mm256_loadu_ps(y + 8 * v);
        _mm256_storeu_ps(out + first + 8 * v, w.bias == nullptr ? lanes : _mm256_add_ps(lanes, _mm256_loadu_ps(w.bias + first + 8 * v)));
      }
      return;
    }
  }
  for (int64_t j = 0; j < count; ++j) actorserve::store_f32(out + first + j, w.bias == nullptr ? y[j] : y[j] + w.bias[first + j]);
}

// Row `row` of `act` against outputs first .. first + 31 of one 64-row weight block, fetching its
// share of the next block meanwhile.
template <int Bits, typename T>
inline void half_block_row(const Activations& act, int64_t row, const WeightBlock& w, int64_t first, T* out,
                           const actorserve::NextBlock& fetch) {
  const int64_t groups = act.dim / kGroup, bytes_per_group = kBlock * kGroup * kStoredBits<Bits> / 8;
  const int8_t* q = act.q + row * act.dim;
  __m256 y[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const int64_t fetch_per_group = fetch.per_step(groups);
  for (int64_t g = 0; g < groups; ++g) {
    fetch.step(g, fetch_per_group);
    __m256i dot[4];
    // The half's weights: bytes first * 4 .. of each 256-byte row of four inputs.
    dot_block<Bits>(w.u + g * bytes_per_group + first * 4, q + g * kGroup, dot);
    const __m256 a = _mm256_set1_ps(act.a[row * groups + g]), s = _mm256_set1_ps(act.s[row * groups + g]);
    for (int v = 0; v < 4; ++v) {
      __m256 d, m;
      block_scales<Bits>(w, g, first + 8 * v, d, m);
      y[v] = add_block(y[v], dot[v], d, m, a, s);
    }
  }
  alignas(32) float lanes[32];
  for (int v = 0; v < 4; ++v) _mm256_store_ps(lanes + 8 * v, y[v]);
  store_half(lanes, w, first, out);
}

// Every row of `act` against one block, a row and a half block a pass; `next`: the block to
// prefetch meanwhile (or nullptr).
template <int Bits, typename T>
inline void block(const Activations& act, int64_t rows, const WeightBlock& w, T* out, int64_t out_stride, const uint8_t* next,
                  int64_t next_bytes) {
  const int64_t halves = (w.count + kBlock / 2 - 1) / (kBlock / 2);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < halves; ++h) {
      const actorserve::NextBlock fetch(next, next_bytes, r * halves + h, rows * halves);
      half_block_row<Bits>(act, r, w, h * kBlock / 2, out + r * out_stride, fetch);
    }
  }
}

// From kWidenedRows rows on the work is compute-bound, and unpacking the weights for every row cost
// about as much as the products: a half block's weights are widened once to a byte each (8-bit:
// u - 128, signed; 5-bit: copied), [groups][8 groups of four inputs][32 outputs][4], and each widened vector feeds
// two rows. Below that, widening costs more than it saves (bench.gguf_matmul, BENCHMARKS.md).
constexpr int64_t kWidenedRows = 8;
constexpr int kPairRows = 2;
constexpr int64_t kWideGroupBytes = kGroup * kBlock / 2;  // one 32-input block of a half: 1 KiB

// The half's scales and minimums as float32 (block_scales' values), [groups][d: 32, m: 32],
// converted once with its weights instead of once per pass of kPairRows rows.
constexpr int64_t kHalfScales = kBlock;

template <int Bits>
inline void widen_half(const WeightBlock& w, int64_t groups, int64_t first, uint8_t* wide, float* scales) {
  const int64_t bytes_per_group = kBlock * kGroup * kStoredBits<Bits> / 8;
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* u = w.u + g * bytes_per_group + first * 4;
    auto* to = reinterpret_cast<__m256i*>(wide + g * kWideGroupBytes);
    for (int v = 0; v < 4; ++v) {
      __m256 d, m;
      block_scales<Bits>(w, g, first + 8 * v, d, m);
      _mm256_storeu_ps(scales + g * kHalfScales + 8 * v, d);
      _mm256_storeu_ps(scales + g * kHalfScales + kBlock / 2 + 8 * v, m);
      if constexpr (Bits == 4) {
        for (int p = 0; p < kGroup / 8; ++p) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + p * kBlock * 4 + 32 * v));
          _mm256_storeu_si256(to + 8 * p + v, _mm256_and_si256(packed, low));
          _mm256_storeu_si256(to + 8 * p + 4 + v, _mm256_and_si256(_mm256_srli_epi16(packed, 4), low));
        }
      } else {
        const __m256i change = Bits == 8 ? flip : _mm256_setzero_si256();
        for (int i = 0; i < kGroup / 4; ++i) {
          _mm256_storeu_si256(to + 4 * i + v, _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + i * kBlock * 4 + 32 * v)), change));
        }
      }
    }
  }
}

// acc[r][v] += maddubs(wide[v], x[r]) (int16 pairs) for one group of four inputs: 4 widened 4- or
// 5-bit weight vectors against two rows. Written out because GCC 12 copied each sum through a second
// register and loaded two of the weight vectors twice: 37 instructions a step where these 25 do, and
// the widened pass of 512 rows ran 1.13x as fast in cache with these (BENCHMARKS.md).
inline void nibble_pair_step(const __m256i* wide, __m256i x0, __m256i x1, __m256i (&acc)[2][4]) {
  __m256i weights, product;
#define ACTORSERVE_PAIR_STEP(V)                          \
  "vmovdqu %[w" #V "], %[weights]\n\t"                  \
  "vpmaddubsw %[x0], %[weights], %[product]\n\t"        \
  "vpaddw %[product], %[a" #V "], %[a" #V "]\n\t"       \
  "vpmaddubsw %[x1], %[weights], %[product]\n\t"        \
  "vpaddw %[product], %[b" #V "], %[b" #V "]\n\t"
  asm(ACTORSERVE_PAIR_STEP(0) ACTORSERVE_PAIR_STEP(1) ACTORSERVE_PAIR_STEP(2) ACTORSERVE_PAIR_STEP(3)
      : [a0] "+x"(acc[0][0]), [a1] "+x"(acc[0][1]), [a2] "+x"(acc[0][2]), [a3] "+x"(acc[0][3]), [b0] "+x"(acc[1][0]),
        [b1] "+x"(acc[1][1]), [b2] "+x"(acc[1][2]), [b3] "+x"(acc[1][3]), [weights] "=&x"(weights), [product] "=&x"(product)
      : [w0] "m"(wide[0]), [w1] "m"(wide[1]), [w2] "m"(wide[2]), [w3] "m"(wide[3]), [x0] "x"(x0), [x1] "x"(x1));
#undef ACTORSERVE_PAIR_STEP
}

// R rows from `row` against the widened half (outputs first .. first + 31): the integer dot
// products half_block_row takes, and its float side (add_block). y lives in memory: the 8
// accumulators, two broadcasts and a weight vector take the registers.
template <int Bits, int R, typename T>
inline void widened_rows(const Activations& act, int64_t row, const uint8_t* wide, const float* scales, const WeightBlock& w,
                         int64_t first, T* out, int64_t out_stride, const actorserve::NextBlock& fetch) {
  const int64_t groups = act.dim / kGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float y[R][32] = {};
  const int64_t fetch_per_group = fetch.per_step(groups);
  for (int64_t g = 0; g < groups; ++g) {
    fetch.step(g, fetch_per_group);
    const auto* wg = reinterpret_cast<const __m256i*>(wide + g * kWideGroupBytes);
    __m256i acc[R][4];  // 4-bit: int16 pairs (8 x 2 x 15 x 127 fits); 5-bit: the same, per half block; 8-bit: int32
    __m256i first_half[R][4];  // 5-bit: the first half block's sums, widened to int32
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_si256();
    // Unrolled whole, GCC computed all 64 products first and spilled them to the stack.
    #pragma GCC unroll 1
    for (int i = 0; i < kGroup / 4; ++i) {
      if constexpr (Bits == 5) {
        if (i == kGroup / 8) {
          for (int r = 0; r < R; ++r)
            for (int v = 0; v < 4; ++v) first_half[r][v] = _mm256_madd_epi16(acc[r][v], ones), acc[r][v] = _mm256_setzero_si256();
        }
      }
      __m256i x[R];
      for (int r = 0; r < R; ++r) x[r] = broadcast4(act.q + (row + r) * act.dim + g * kGroup + 4 * i);
      if constexpr (Bits != 8 && R == 2) {
        nibble_pair_step(wg + 4 * i, x[0], x[1], acc);
      } else {
        for (int v = 0; v < 4; ++v) {
          const __m256i wv = _mm256_loadu_si256(wg + 4 * i + v);
          if constexpr (Bits != 8) {
            for (int r = 0; r < R; ++r) acc[r][v] = _mm256_add_epi16(acc[r][v], _mm256_maddubs_epi16(wv, x[r]));
          } else {
            const __m256i magnitude = _mm256_abs_epi8(wv);
            for (int r = 0; r < R; ++r) {
              acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x[r], wv)), ones));
            }
          }
        }
      }
    }
    const float* dm = scales + g * kHalfScales;
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row + r) * groups + g;
      const __m256 a = _mm256_set1_ps(act.a[at]), s = _mm256_set1_ps(act.s[at]);
      for (int v = 0; v < 4; ++v) {
        __m256i dot = acc[r][v];
        if constexpr (Bits == 4) dot = _mm256_madd_epi16(dot, ones);
        if constexpr (Bits == 5) dot = _mm256_add_epi32(first_half[r][v], _mm256_madd_epi16(dot, ones));
        const __m256 d = _mm256_loadu_ps(dm + 8 * v), m = _mm256_loadu_ps(dm + kBlock / 2 + 8 * v);
        _mm256_store_ps(y[r] + 8 * v, add_block(_mm256_load_ps(y[r] + 8 * v), dot, d, m, a, s));
      }
    }
  }
  for (int r = 0; r < R; ++r) store_half(y[r], w, first, out + (row + r) * out_stride);
}

// Every row of `act` against half `half` of a block, written to out (the block's first output of
// row 0); `next`: the block to prefetch meanwhile (or nullptr).
template <int Bits, typename T>
inline void rows_against_half(const Activations& act, int64_t rows, const WeightBlock& w, int64_t half, T* out, int64_t out_stride,
                              const uint8_t* next, int64_t next_bytes) {
  const int64_t groups = act.dim / kGroup, first = half * kBlock / 2;
  thread_local actorserve::ThreadBuffer<uint8_t> wide_buffer;
  thread_local actorserve::ThreadBuffer<float> scales_buffer;
  uint8_t* wide = wide_buffer.get(groups * kWideGroupBytes);
  float* scales = scales_buffer.get(groups * kHalfScales);
  widen_half<Bits>(w, groups, first, wide, scales);
  actorserve::row_passes<kPairRows>(rows, next, next_bytes, [&]<int R>(int64_t r, const actorserve::NextBlock& fetch) {
    widened_rows<Bits, R>(act, r, wide, scales, w, first, out, out_stride, fetch);
  });
}

}  // namespace avx2
#endif

#ifdef ACTORSERVE_GGUF_KERNEL
template <int Bits, typename T>
void matmul_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& minimum,
                 const float* bias, int64_t width, at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1), n = out.size(1), groups = dim / kGroup;
  // The quantized activations live in buffers of the calling thread (thread_buffer.h).
  thread_local actorserve::ThreadBuffer<int8_t> q;
  thread_local actorserve::ThreadBuffer<float> a, s;
  const T* xd = x.data_ptr<T>();
  int8_t* qd = q.get(rows * dim);
  float* ad = a.get(rows * groups);
  float* sd = s.get(rows * groups);
  actorserve::parallel_for(rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) quantize_blocks(xd + r * dim, dim, qd + r * dim, ad + r * groups, sd + r * groups);
  });
  const Activations act{qd, ad, sd, dim};
  const uint8_t* ud = weight.data_ptr<uint8_t>();
  const auto* dd = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  const auto* md = reinterpret_cast<const uint16_t*>(minimum.data_ptr<at::Half>());
  const int64_t block_bytes = kBlock * dim * kStoredBits<Bits> / 8;
  T* out_d = out.data_ptr<T>();
  const int64_t blocks = weight.size(0);
  auto weight_block = [&](int64_t b) {
    const int64_t col = b * kBlock;
    return WeightBlock{ud + b * block_bytes, dd + b * groups * kBlock, md + b * groups * kBlock, bias == nullptr ? nullptr : bias + col,
                       std::min(kBlock, n - col)};
  };
#ifdef ACTORSERVE_GGUF_VNNI
  if (width == 512 && rows >= vnni::kHalfBlockRows) {
    actorserve::for_each_half_block(blocks, [&](int64_t b, int64_t half, bool fetch_next) {
      const WeightBlock w = weight_block(b);
      const uint8_t* next = fetch_next ? ud + (b + 1) * block_bytes : nullptr;
      if (half == 0) {
        vnni::rows_against<kStoredBits<Bits>, 2, 0, vnni::kHalfRows>(act, rows, w, out_d + b * kBlock, n, next, block_bytes);
      } else if (w.count > kBlock / 2) {
        vnni::rows_against<kStoredBits<Bits>, 2, 2, vnni::kHalfRows>(act, rows, w, out_d + b * kBlock, n, next, block_bytes);
      }
    });
    return;
  }
#endif
#ifdef ACTORSERVE_GGUF_AVX2
  if (width == 256 && rows >= avx2::kWidenedRows) {
    actorserve::for_each_half_block(blocks, [&](int64_t b, int64_t half, bool fetch_next) {
      const WeightBlock w = weight_block(b);
      if (half == 1 && w.count <= kBlock / 2) return;
      avx2::rows_against_half<Bits>(act, rows, w, half, out_d + b * kBlock, n, fetch_next ? ud + (b + 1) * block_bytes : nullptr, block_bytes);
    });
    return;
  }
#endif
  actorserve::parallel_for(blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const WeightBlock w = weight_block(b);
#ifdef ACTORSERVE_GGUF_VNNI
      if (width == 512) {
        vnni::rows_against<kStoredBits<Bits>, 4, 0, vnni::kBlockRows>(act, rows, w, out_d + b * kBlock, n, b + 1 < last ? ud + (b + 1) * block_bytes : nullptr,
                                                        block_bytes);
        continue;
      }
#endif
#ifdef ACTORSERVE_GGUF_AVX2
      avx2::block<Bits>(act, rows, w, out_d + b * kBlock, n, b + 1 < last ? ud + (b + 1) * block_bytes : nullptr, block_bytes);
#endif
    }
  });
}
#endif

// x [rows, K] float32/bfloat16/float16; weight [ceil(N/64), K*S/32, 64, 4] uint8, S = 4 bits a
// weight where code_bits (u < 2^code_bits) is 4, else 8 (code_bits 5 or 8); scale and minimum
// [ceil(N/64), K/32, 64] float16, as GGUF stores them. width: the path, one of `widths()` (the
// tests and benchmarks compare them).
at::Tensor gguf_matmul_at(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& minimum,
                          const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t code_bits, int64_t width) {
  const auto& compiled = compiled_widths();
  TORCH_CHECK(std::find(compiled.begin(), compiled.end(), width) != compiled.end(), "gguf_matmul has no ", width,
              "-bit path here (AVX512-VNNI: 512, AVX2: 256; see gguf_matmul_widths)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(1) % kGroup == 0,
              "x must be a contiguous [rows, features] CPU tensor with a multiple of 32 features");
  const int64_t dim = x.size(1);
  TORCH_CHECK(code_bits == 4 || code_bits == 5 || code_bits == 8, "code_bits must be 4, 5 or 8");
  TORCH_CHECK(weight.dim() == 4 && weight.scalar_type() == at::kByte && weight.size(2) == kBlock && weight.size(3) == 4 &&
                  weight.is_contiguous() && weight.size(1) * (code_bits == 4 ? 8 : 4) == dim,
              "weight must come from gpu/gguf_linear.py's packing, for x's features and code_bits");
  TORCH_CHECK(out_features > (weight.size(0) - 1) * kBlock && out_features <= weight.size(0) * kBlock,
              "out_features does not match the packed weight");
  for (const at::Tensor* t : {&scale, &minimum}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == weight.size(0) &&
                    t->size(1) == dim / kGroup && t->size(2) == kBlock,
                "scale and minimum must be float16 [blocks, features / 32, 64]");
  }
  const float* bias_data = actorserve::bias_data(bias, out_features);
  auto out = at::empty({x.size(0), out_features}, x.options());
#ifdef ACTORSERVE_GGUF_KERNEL
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gguf_matmul", [&] {
    if (code_bits == 4) {
      matmul_impl<4, scalar_t>(x, weight, scale, minimum, bias_data, width, out);
    } else if (code_bits == 5) {
      matmul_impl<5, scalar_t>(x, weight, scale, minimum, bias_data, width, out);
    } else {
      matmul_impl<8, scalar_t>(x, weight, scale, minimum, bias_data, width, out);
    }
  });
#endif
  return out;
}

// gguf_matmul_at on the widest path compiled.
at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& minimum,
                       const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t code_bits) {
  TORCH_CHECK(gguf_matmul_available(), "gguf_matmul needs AVX2 or AVX512-VNNI (see gguf_matmul_available)");
  return gguf_matmul_at(x, weight, scale, minimum, bias, out_features, code_bits, compiled_widths().front());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve, m) {
  m.def("gguf_matmul_available() -> bool", &gguf_matmul_available);
  m.def("gguf_matmul_widths() -> int[]", &widths);
  m.def("gguf_matmul(Tensor x, Tensor weight, Tensor scale, Tensor minimum, Tensor? bias, int out_features, int code_bits) -> Tensor");
  m.def("gguf_matmul_at(Tensor x, Tensor weight, Tensor scale, Tensor minimum, Tensor? bias, int out_features, int code_bits, "
        "int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(actorserve, CPU, m) {
  m.impl("gguf_matmul", &gguf_matmul);
  m.impl("gguf_matmul_at", &gguf_matmul_at);
}
