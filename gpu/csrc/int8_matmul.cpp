// int8 linear layers on a CPU with AVX512-VNNI or AVX2: y = dequantize(quantize_rows(x) . W^T).
//
// gpu/packed_linear.py's Int8Linear quantizes each activation row with its own scale and
// multiplies by int8 weights with one scale per output row. oneDNN's u8 x s8 kernel does the
// integer part well for many rows, but a decode step at batch 1 is a matrix-vector product bound
// by reading the weights, and oneDNN's path there ran at about a third of the memory bandwidth.
// This kernel reads the weights once, as one sequential stream: they are repacked so that each
// block of 64 output rows is contiguous, four input features at a time ([N/64][K/4][64][4]), so
// one 64-byte load feeds one VNNI instruction (`vpdpbusd`: 16 lanes of four u8 x s8 products)
// and each lane accumulates one output row; no horizontal sums. Several activation rows share
// each weight load (see kHalfRows). CPUs with AVX2 but not AVX512-VNNI take a 256-bit path on the
// same layout (`vpmaddubsw`, see namespace avx2): there oneDNN's kernel saturates int16 sums of
// 8-bit weights, so without this path int8 layers need 7-bit weights (gpu/packed_linear.py).
//
// The arithmetic is Int8Linear's exactly: activations quantized as quantize_rows does (q + 128 as
// u8), the integer dot product with the weights exact (VNNI takes the zero point out with the
// weights' row sums), then float(dot) * weight_scale, * row_scale, + bias, each rounded as the
// oneDNN path rounds. Built into the int8 extension (gpu/packed_linear.py's int8_kernels);
// `int8_matmul_widths()` lists the paths compiled, and where there is none
// `int8_matmul_available()` is false and Int8Linear keeps oneDNN's path.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "linear_bias.h"
#include "half_blocks.h"
#include "parallel.h"
#include "quantize_row.h"
#include "thread_buffer.h"

#include <algorithm>
#include <cstring>

#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ACTORSERVE_INT8_VNNI 1
#include "store_lanes.h"
#endif
#if defined(__AVX2__)
#define ACTORSERVE_INT8_AVX2 1
#include <immintrin.h>
#endif

namespace {

using actorserve::kZeroPoint;
constexpr int64_t kBlock = 64;  // output rows per weight block: four 16-lane (VNNI) or eight 8-lane (AVX2) vectors

// Vector widths in bits of the paths compiled here, widest first: 512 (AVX512-VNNI), 256 (AVX2).
const std::vector<int64_t>& compiled_widths() {
  static const std::vector<int64_t> widths = {
#ifdef ACTORSERVE_INT8_VNNI
      512,
#endif
#ifdef ACTORSERVE_INT8_AVX2
      256,
#endif
  };
  return widths;
}

std::vector<int64_t> widths() { return compiled_widths(); }

bool int8_matmul_available() { return !compiled_widths().empty(); }

// W [N, K] int8 -> [ceil(N/64)][ceil(K/4)][64][4], zero-padded; and each output row's sum of
// weights times the zero point, which the u8 activations add to every dot product.
std::tuple<at::Tensor, at::Tensor> int8_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              "weight must be an int8 [out_features, in_features] CPU tensor");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t blocks = (n + kBlock - 1) / kBlock, k4 = (k + 3) / 4;
  auto packed = at::zeros({blocks, k4, kBlock, 4}, w.options());
  auto offsets = at::empty({blocks * kBlock}, w.options().dtype(at::kInt));
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* off = offsets.data_ptr<int32_t>();
  for (int64_t row = 0; row < blocks * kBlock; ++row) {
    int32_t sum = 0;
    if (row < n) {
      const int64_t b = row / kBlock, lane = row % kBlock;
      for (int64_t col = 0; col < k; ++col) {
        const int8_t v = src[row * k + col];
        dst[((b * k4 + col / 4) * kBlock + lane) * 4 + col % 4] = v;
        sum += v;
      }
    }
    off[row] = kZeroPoint * sum;
  }
  return {packed, offsets};
}

// quantize_row (quantize_row.h) into rows padded to `stride` bytes with q = 0: q + Offset as u8
// (VNNI: the zero point, which the offsets take out) or as int8 (AVX2, Offset 0).
template <int Offset, typename T>
void quantize_into(const T* x, int64_t rows, int64_t dim, int64_t stride, uint8_t* q, float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* dst = q + r * stride;
    if constexpr (Offset == 0) {
      scale[r] = actorserve::quantize_row<0>(x + r * dim, dim, reinterpret_cast<int8_t*>(dst));
    } else {
      scale[r] = actorserve::quantize_row<Offset>(x + r * dim, dim, dst);
    }
    std::fill(dst + dim, dst + stride, static_cast<uint8_t>(Offset));
  }
}

struct Epilogue {
  const int32_t* offset;  // the block's first output (VNNI: the zero point's share of each dot product)
  const float* w_scale;
  const float* bias;  // or nullptr
  int64_t count;      // outputs of the block that exist (the last block may be short)
};

#ifdef ACTORSERVE_INT8_VNNI
namespace vnni {

using actorserve::store16;
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// What Int8Linear's dequantize does with oneDNN's float output, 16 outputs at a time:
// (dot * w_scale) * row_scale + bias. The explicit-rounding forms are never fused into an FMA.
// Lanes past `count` read nothing (the scales and bias end with the layer's outputs).
inline __m512 dequantize16(__m512i dot, const int32_t* offset, const float* w_scale, __m512 row_scale, const float* bias,
                           int64_t count) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1);
  const __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, _mm512_loadu_si512(offset)));
  __m512 y = _mm512_mul_round_ps(_mm512_mul_round_ps(exact, _mm512_maskz_loadu_ps(lanes, w_scale), kRound), row_scale, kRound);
  return bias == nullptr ? y : _mm512_add_round_ps(y, _mm512_maskz_loadu_ps(lanes, bias), kRound);
}

// The path for `multiply`: 4 vectors of 16 outputs a block. Rows a pass: whole blocks take up to
// two, for few rows, where the weights' reads bound the time; from kHalfBlockRows rows on, half
// blocks take five: 5 x 2 accumulators and 2 weight vectors keep `vpdpbusd` near one a cycle, where
// six rows of whole blocks (24 accumulators) ran at half that.
struct Path {
  static constexpr int kVectors = 4, kBlockRows = 2, kHalfRows = 5;
  static constexpr int64_t kHalfBlockRows = 4;

  // R activation rows against vectors T0 .. T0 + V - 1 (16 outputs each) of one 64-row weight
  // block, written out dequantized; the pass's share of the next block is fetched every 32 inputs.
  template <int R, int V, int T0, typename T>
  static void rows(const uint8_t* q, int64_t stride, const float* row_scale, const int8_t* w, int64_t k4,
                   const Epilogue& e, T* out, int64_t out_stride, const actorserve::NextBlock& fetch) {
    __m512i acc[R][V];
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < V; ++t) acc[r][t] = _mm512_setzero_si512();
    }
    const int64_t fetch_per_group = fetch.per_step((k4 + 7) / 8);
    for (int64_t i = 0; i < k4; ++i) {
      if (i % 8 == 0) fetch.step(i / 8, fetch_per_group);
      const int8_t* wi = w + i * kBlock * 4 + 64 * T0;
      __m512i wv[V];
      for (int t = 0; t < V; ++t) wv[t] = _mm512_loadu_si512(wi + 64 * t);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, q + r * stride + i * 4, sizeof four);
        const __m512i a = _mm512_set1_epi32(four);
        for (int t = 0; t < V; ++t) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], a, wv[t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(row_scale[r]);
      for (int t = 0; t < V; ++t) {
        const int64_t first = 16 * (T0 + t), count = std::min<int64_t>(16, e.count - first);
        if (count <= 0) break;
        const __m512 y = dequantize16(acc[r][t], e.offset + first, e.w_scale + first, scale, e.bias == nullptr ? nullptr : e.bias + first, count);
        store16(out + r * out_stride + first, y, count);
      }
    }
  }
};

}  // namespace vnni
#endif

#ifdef ACTORSERVE_INT8_AVX2
// 8 outputs per vector (32 bytes of the layout: 8 outputs x 4 inputs). `vpmaddubsw` multiplies u8
// x s8 into int16 pairs with saturation, and the activations' u8 (q + 128, up to 255) against
// weights up to 127 would overflow a pair: here the activations are quantized as q (int8, |q| <= 127),
// the weights' magnitude as the unsigned operand with their sign moved onto the activations
// (`vpsignb`), so a pair is at most 2 * 127 * 127 and the dot product is exact without the zero
// point; `vpmaddwd` with ones sums the pairs into int32.
namespace avx2 {

// Four activations of a row (int8), in every lane.
inline __m256i broadcast4(const uint8_t* q) {
  int32_t four;
  std::memcpy(&four, q, sizeof four);
  return _mm256_set1_epi32(four);
}

// The first `count` of 8 lanes (a block's last outputs may be fewer than 8).
inline __m256i lanes_below(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 load8(const float* p, int64_t count) {
  return count == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(count));
}

// float32 (what AVX2 CPUs run) 8 lanes a store; other types through store_f32's rounding.
template <typename T>
inline void store8(T* out, __m256 y, int64_t count) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, y);
  for (int64_t j = 0; j < count; ++j) actorserve::store_f32(out + j, lanes[j]);
}

template <>
inline void store8<float>(float* out, __m256 y, int64_t count) {
  if (count == 8) {
    _mm256_storeu_ps(out, y);
  } else {
    _mm256_maskstore_ps(out, lanes_below(count), y);
  }
}

// Int8Linear's dequantize for 8 outputs: (dot * w_scale) * row_scale + bias, rounded after each
// operation. The barrier keeps the compiler from fusing the last multiply and add into an FMA.
template <typename T>
inline void dequantize8(__m256i dot, const float* w_scale, float row_scale, const float* bias, int64_t count, T* out) {
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), load8(w_scale, count)), _mm256_set1_ps(row_scale));
  if (bias != nullptr) {
    asm("" : "+x"(y));
    y = _mm256_add_ps(y, load8(bias, count));
  }
  store8(out, y, count);
}

// The path for `multiply`: 8 vectors of 8 outputs a block. Rows a pass: a single row takes whole
// blocks, where the weights' reads bound the time; from kHalfBlockRows rows half blocks take two
// rows a pass (8 accumulators, a weight vector, its magnitude and two broadcasts within AVX2's 16
// registers).
struct Path {
  static constexpr int kVectors = 8, kBlockRows = 1, kHalfRows = 2;
  static constexpr int64_t kHalfBlockRows = 2;

  // R activation rows against vectors T0 .. T0 + V - 1 (8 outputs each) of one 64-row weight block,
  // written out dequantized; the pass's share of the next block is fetched every 32 inputs.
  template <int R, int V, int T0, typename T>
  static void rows(const uint8_t* q, int64_t stride, const float* row_scale, const int8_t* w, int64_t k4,
                   const Epilogue& e, T* out, int64_t out_stride, const actorserve::NextBlock& fetch) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[R][V];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < V; ++t) acc[r][t] = _mm256_setzero_si256();
    const int64_t fetch_per_group = fetch.per_step((k4 + 7) / 8);
    for (int64_t i = 0; i < k4; ++i) {
      if (i % 8 == 0) fetch.step(i / 8, fetch_per_group);
      __m256i x[R];
      for (int r = 0; r < R; ++r) x[r] = broadcast4(q + r * stride + i * 4);
      const int8_t* wi = w + i * kBlock * 4 + 32 * T0;
      for (int t = 0; t < V; ++t) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wi + 32 * t));
        const __m256i magnitude = _mm256_abs_epi8(wv);
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x[r], wv)), ones));
        }
      }
    }
    for (int t = 0; t < V; ++t) {
      const int64_t first = 8 * (T0 + t), count = std::min<int64_t>(8, e.count - first);
      if (count <= 0) break;
      for (int r = 0; r < R; ++r) {
        dequantize8(acc[r][t], e.w_scale + first, row_scale[r], e.bias == nullptr ? nullptr : e.bias + first, count,
                    out + r * out_stride + first);
      }
    }
  }
};

}  // namespace avx2
#endif

#if defined(ACTORSERVE_INT8_VNNI) || defined(ACTORSERVE_INT8_AVX2)
// Every row against vectors T0 .. T0 + V - 1 of one weight block (all of them, or one half),
// MaxRows rows a pass, prefetching `next` (or nullptr) meanwhile.
template <typename Path, int V, int T0, int MaxRows, typename T>
inline void rows_against(const uint8_t* q, int64_t rows, int64_t stride, const float* row_scale, const int8_t* w, int64_t k4,
                         const Epilogue& e, T* out, int64_t out_stride, const int8_t* next) {
  actorserve::row_passes<MaxRows>(rows, next, k4 * kBlock * 4, [&]<int R>(int64_t r, const actorserve::NextBlock& fetch) {
    Path::template rows<R, V, T0>(q + r * stride, stride, row_scale + r, w, k4, e, out + r * out_stride, out_stride, fetch);
  });
}

// Every row of the quantized activations (`rows` of `stride` bytes, their scales `sd`) against
// every block of the packed weights `wd`, written to out_d (n outputs a row), on a path's vectors:
// whole blocks for few rows, else half blocks shared between threads (half_blocks.h).
template <typename Path, typename T, typename Blocks>
void multiply(const uint8_t* qd, const float* sd, int64_t rows, int64_t stride, const int8_t* wd, int64_t blocks, int64_t k4,
              const Blocks& epilogue, T* out_d, int64_t n) {
  constexpr int kAll = Path::kVectors, kHalf = Path::kVectors / 2;
  const int64_t block_bytes = k4 * kBlock * 4;
  if (rows < Path::kHalfBlockRows) {
    actorserve::parallel_for(blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        rows_against<Path, kAll, 0, Path::kBlockRows>(qd, rows, stride, sd, wd + b * block_bytes, k4, epilogue(b), out_d + b * kBlock, n,
                                                      b + 1 < last ? wd + (b + 1) * block_bytes : nullptr);
      }
    });
    return;
  }
  actorserve::for_each_half_block(blocks, [&](int64_t b, int64_t half, bool fetch_next) {
    const Epilogue e = epilogue(b);
    const int8_t* next = fetch_next ? wd + (b + 1) * block_bytes : nullptr;
    if (half == 0) {
      rows_against<Path, kHalf, 0, Path::kHalfRows>(qd, rows, stride, sd, wd + b * block_bytes, k4, e, out_d + b * kBlock, n, next);
    } else if (e.count > kBlock / 2) {
      rows_against<Path, kHalf, kHalf, Path::kHalfRows>(qd, rows, stride, sd, wd + b * block_bytes, k4, e, out_d + b * kBlock, n, next);
    }
  });
}

template <typename T>
void matmul_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets, const at::Tensor& w_scale,
                 const float* bias, int64_t width, at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1), n = out.size(1);
  const int64_t blocks = packed.size(0), k4 = packed.size(1), stride = k4 * 4;
  thread_local actorserve::ThreadBuffer<uint8_t> q;  // thread_buffer.h
  thread_local actorserve::ThreadBuffer<float> row_scale;
  uint8_t* qd = q.get(rows * stride);
  float* sd = row_scale.get(rows);
  const T* xd = x.data_ptr<T>();
  actorserve::parallel_for(rows, 16, [&](int64_t first, int64_t last) {
    if (width == 512) {
      quantize_into<kZeroPoint>(xd + first * dim, last - first, dim, stride, qd + first * stride, sd + first);
    } else {
      quantize_into<0>(xd + first * dim, last - first, dim, stride, qd + first * stride, sd + first);
    }
  });
  const int8_t* wd = packed.data_ptr<int8_t>();
  const int32_t* od = offsets.data_ptr<int32_t>();
  const float* scale = w_scale.data_ptr<float>();
  T* out_d = out.data_ptr<T>();
  auto epilogue = [&](int64_t b) {
    const int64_t col = b * kBlock;
    return Epilogue{od + col, scale + col, bias == nullptr ? nullptr : bias + col, std::min(kBlock, n - col)};
  };
#ifdef ACTORSERVE_INT8_VNNI
  if (width == 512) {
    multiply<vnni::Path>(qd, sd, rows, stride, wd, blocks, k4, epilogue, out_d, n);
    return;
  }
#endif
#ifdef ACTORSERVE_INT8_AVX2
  multiply<avx2::Path>(qd, sd, rows, stride, wd, blocks, k4, epilogue, out_d, n);
#endif
}
#endif

// width: the path, one of `widths()` (the tests and benchmarks compare them).
at::Tensor int8_matmul_at(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets, const at::Tensor& w_scale,
                          const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t width) {
  const auto& compiled = compiled_widths();
  TORCH_CHECK(std::find(compiled.begin(), compiled.end(), width) != compiled.end(), "int8_matmul has no ", width,
              "-bit path here (AVX512-VNNI: 512, AVX2: 256; see int8_matmul_widths)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, features] CPU tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(2) == kBlock && packed.size(3) == 4,
              "packed must come from int8_pack_weight");
  TORCH_CHECK(x.size(1) <= packed.size(1) * 4 && x.size(1) > (packed.size(1) - 1) * 4, "x's features do not match the weight's");
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kBlock && out_features <= packed.size(0) * kBlock,
              "out_features does not match the packed weight");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == out_features,
              "weight_scale must be float32 with one value per output feature");
  TORCH_CHECK(offsets.scalar_type() == at::kInt && offsets.numel() == packed.size(0) * kBlock, "offsets must come from int8_pack_weight");
  const float* bias_data = actorserve::bias_data(bias, out_features);
  auto out = at::empty({x.size(0), out_features}, x.options());
#if defined(ACTORSERVE_INT8_VNNI) || defined(ACTORSERVE_INT8_AVX2)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_matmul",
                                  [&] { matmul_impl<scalar_t>(x, packed, offsets, w_scale, bias_data, width, out); });
#endif
  return out;
}

// int8_matmul_at on the widest path compiled.
at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets, const at::Tensor& w_scale,
                       const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(int8_matmul_available(), "int8_matmul needs AVX512-VNNI or AVX2 (see int8_matmul_available)");
  return int8_matmul_at(x, packed, offsets, w_scale, bias, out_features, compiled_widths().front());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve, m) {
  m.def("int8_matmul_available() -> bool", &int8_matmul_available);
  m.def("int8_matmul_widths() -> int[]", &widths);
  m.def("int8_pack_weight(Tensor weight) -> (Tensor, Tensor)");
  m.def("int8_matmul(Tensor x, Tensor packed, Tensor offsets, Tensor weight_scale, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_matmul_at(Tensor x, Tensor packed, Tensor offsets, Tensor weight_scale, Tensor? bias, int out_features, "
        "int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(actorserve, CPU, m) {
  m.impl("int8_pack_weight", &int8_pack_weight);
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int8_matmul_at", &int8_matmul_at);
}
