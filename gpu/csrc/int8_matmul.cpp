// int8 linear layers with AVX512-VNNI, on a CPU: y = dequantize(quantize_rows(x) . W^T).
//
// gpu/packed_linear.py's Int8Linear quantizes each activation row with its own scale and
// multiplies by int8 weights with one scale per output row. oneDNN's u8 x s8 kernel does the
// integer part well for many rows, but a decode step at batch 1 is a matrix-vector product bound
// by reading the weights, and oneDNN's path there ran at about a third of the memory bandwidth.
// This kernel reads the weights once, as one sequential stream: they are repacked so that each
// block of 64 output rows is contiguous, four input features at a time ([N/64][K/4][64][4]), so
// one 64-byte load feeds one VNNI instruction (`vpdpbusd`: 16 lanes of four u8 x s8 products)
// and each lane accumulates one output row; no horizontal sums. Several activation rows share
// each weight load (see kHalfRows).
//
// The arithmetic is Int8Linear's exactly: activations quantized as quantize_rows does (q + 128 as
// u8), the zero point taken out with the weights' row sums (the integer dot product is exact),
// then float(dot) * weight_scale, * row_scale, + bias, each rounded as the oneDNN path rounds.
// Built into the int8 extension (gpu/packed_linear.py's int8_kernels); on a CPU without
// AVX512-VNNI `int8_matmul_available()` is false and Int8Linear keeps oneDNN's path.
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ACTORSERVE_INT8_VNNI 1
#include "store_lanes.h"
#endif

namespace {

using actorserve::kZeroPoint;
constexpr int64_t kBlock = 64;  // output rows per weight block: four 16-lane accumulators

bool int8_matmul_available() {
#ifdef ACTORSERVE_INT8_VNNI
  return true;
#else
  return false;
#endif
}

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

// quantize_row (quantize_row.h) into rows padded to `stride` bytes with the zero point, so the
// padding adds nothing once the offsets are taken out.
template <typename T>
void quantize_into(const T* x, int64_t rows, int64_t dim, int64_t stride, uint8_t* q, float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* dst = q + r * stride;
    scale[r] = actorserve::quantize_row(x + r * dim, dim, dst);
    std::fill(dst + dim, dst + stride, static_cast<uint8_t>(kZeroPoint));
  }
}

#ifdef ACTORSERVE_INT8_VNNI
using actorserve::store16;
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
// Rows a pass. Whole blocks (4 vectors of 16 outputs) take up to two, for few rows, where the
// weights' reads bound the time; from kHalfBlockRows rows on, half blocks take five: 5 x 2
// accumulators and 2 weight vectors keep `vpdpbusd` near one a cycle, where six rows
// of whole blocks (24 accumulators) ran at half that.
constexpr int kBlockRows = 2, kHalfRows = 5;
constexpr int64_t kHalfBlockRows = 4;

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

struct Epilogue {
  const int32_t* offset;  // the block's first output
  const float* w_scale;
  const float* bias;  // or nullptr
  int64_t count;      // outputs of the block that exist (the last block may be short)
};

// R activation rows against vectors T0 .. T0 + V - 1 (16 outputs each) of one 64-row weight
// block, written out dequantized; the pass's share of the next block is fetched every 32 inputs.
template <int R, int V, int T0, typename T>
inline void block_rows(const uint8_t* q, int64_t stride, const float* row_scale, const int8_t* w, int64_t k4,
                       const Epilogue& e, T* out, int64_t out_stride, const actorserve::NextBlock& fetch) {
  __m512i acc[R][V];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < V; ++t) acc[r][t] = _mm512_setzero_si512();
  }
  for (int64_t i = 0; i < k4; ++i) {
    if (i % 8 == 0) fetch.step(i / 8, (k4 + 7) / 8);
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

// Every row against one whole block (T0 = 0, V = 4) or one half of it (T0 = 0 or 2, V = 2), MaxRows
// rows a pass, prefetching `next` (or nullptr) meanwhile.
template <int V, int T0, int MaxRows, typename T>
inline void rows_against(const uint8_t* q, int64_t rows, int64_t stride, const float* row_scale, const int8_t* w, int64_t k4,
                         const Epilogue& e, T* out, int64_t out_stride, const int8_t* next) {
  actorserve::row_passes<MaxRows>(rows, next, k4 * kBlock * 4, [&]<int R>(int64_t r, const actorserve::NextBlock& fetch) {
    block_rows<R, V, T0>(q + r * stride, stride, row_scale + r, w, k4, e, out + r * out_stride, out_stride, fetch);
  });
}

template <typename T>
void matmul_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets, const at::Tensor& w_scale,
                 const float* bias, at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1), n = out.size(1);
  const int64_t blocks = packed.size(0), k4 = packed.size(1), stride = k4 * 4;
  thread_local actorserve::ThreadBuffer<uint8_t> q;  // thread_buffer.h
  thread_local actorserve::ThreadBuffer<float> row_scale;
  uint8_t* qd = q.get(rows * stride);
  float* sd = row_scale.get(rows);
  const T* xd = x.data_ptr<T>();
  actorserve::parallel_for(rows, 16, [&](int64_t first, int64_t last) {
    quantize_into(xd + first * dim, last - first, dim, stride, qd + first * stride, sd + first);
  });
  const int8_t* wd = packed.data_ptr<int8_t>();
  const int32_t* od = offsets.data_ptr<int32_t>();
  const float* scale = w_scale.data_ptr<float>();
  T* out_d = out.data_ptr<T>();
  const int64_t block_bytes = k4 * kBlock * 4;
  auto epilogue = [&](int64_t b) {
    const int64_t col = b * kBlock;
    return Epilogue{od + col, scale + col, bias == nullptr ? nullptr : bias + col, std::min(kBlock, n - col)};
  };
  if (rows < kHalfBlockRows) {
    actorserve::parallel_for(blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        rows_against<4, 0, kBlockRows>(qd, rows, stride, sd, wd + b * block_bytes, k4, epilogue(b), out_d + b * kBlock, n,
                                       b + 1 < last ? wd + (b + 1) * block_bytes : nullptr);
      }
    });
    return;
  }
  actorserve::for_each_half_block(blocks, [&](int64_t b, int64_t half, bool fetch_next) {
    const Epilogue e = epilogue(b);
    const int8_t* next = fetch_next ? wd + (b + 1) * block_bytes : nullptr;
    if (half == 0) {
      rows_against<2, 0, kHalfRows>(qd, rows, stride, sd, wd + b * block_bytes, k4, e, out_d + b * kBlock, n, next);
    } else if (e.count > kBlock / 2) {
      rows_against<2, 2, kHalfRows>(qd, rows, stride, sd, wd + b * block_bytes, k4, e, out_d + b * kBlock, n, next);
    }
  });
}
#endif

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& offsets, const at::Tensor& w_scale,
                       const c10::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(int8_matmul_available(), "int8_matmul needs AVX512-VNNI (see int8_matmul_available)");
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
#ifdef ACTORSERVE_INT8_VNNI
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_matmul",
                                  [&] { matmul_impl<scalar_t>(x, packed, offsets, w_scale, bias_data, out); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve, m) {
  m.def("int8_matmul_available() -> bool", &int8_matmul_available);
  m.def("int8_pack_weight(Tensor weight) -> (Tensor, Tensor)");
  m.def("int8_matmul(Tensor x, Tensor packed, Tensor offsets, Tensor weight_scale, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(actorserve, CPU, m) {
  m.impl("int8_pack_weight", &int8_pack_weight);
  m.impl("int8_matmul", &int8_matmul);
}
