// Per-row (per-token) int8 quantization around oneDNN's int8 matmul, on a CPU.
//
// gpu/packed_linear.py's Int8Linear quantizes each activation row with its own scale, multiplies
// by oneDNN (`onednn::qlinear_pointwise` with activation scale 1, so its float32 output is the
// integer dot product times the weight's per-channel scale), then scales each output row back. In
// torch each side is five or six ops over the activations; here each is one pass. The arithmetic
// is the torch fallback's (quantize_rows_torch, dequantize_rows_torch), operation for operation.
// Built as an extension of its own (gpu/packed_linear.py's int8_kernels), loaded only when a
// model is quantized.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "cpu_math.h"
#include "parallel.h"
#include "quantize_row.h"

#include <tuple>

namespace {

using actorserve::store_f32;

// quantize_row (quantize_row.h) for every row.
template <typename T>
void quantize_rows_impl(const at::Tensor& x, at::Tensor& q, at::Tensor& scale) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const T* xd = x.data_ptr<T>();
  uint8_t* qd = q.data_ptr<uint8_t>();
  float* sd = scale.data_ptr<float>();
  actorserve::parallel_for(rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) sd[r] = actorserve::quantize_row(xd + r * dim, dim, qd + r * dim);
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, features] CPU tensor");
  auto q = at::empty(x.sizes(), x.options().dtype(at::kByte));
  auto scale = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows",
                                  [&] { quantize_rows_impl<scalar_t>(x, q, scale); });
  return {q, scale};
}

// out = (acc * scale[row] + bias) in the output dtype, the product and sum in float32.
template <typename T>
void dequantize_rows_impl(const at::Tensor& acc, const at::Tensor& scale, const float* bias, at::Tensor& out) {
  const int64_t dim = acc.size(-1), rows = acc.size(0);
  const float* ad = acc.data_ptr<float>();
  const float* sd = scale.data_ptr<float>();
  T* od = out.data_ptr<T>();
  actorserve::parallel_for(rows, 4, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* a = ad + r * dim;
      const float s = sd[r];
      T* o = od + r * dim;
      if (bias == nullptr) {
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) store_f32(o + d, a[d] * s);
      } else {
        // Two roundings, as torch's separate multiply and add (no fused multiply-add).
        for (int64_t d = 0; d < dim; ++d) {
          volatile float product = a[d] * s;
          store_f32(o + d, product + bias[d]);
        }
      }
    }
  });
}

at::Tensor dequantize_rows(const at::Tensor& acc, const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                           at::ScalarType dtype) {
  TORCH_CHECK(acc.device().is_cpu() && acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kFloat,
              "acc must be a contiguous float32 [rows, features] CPU tensor");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == acc.size(0),
              "scale must be float32 with one value per row");
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == acc.size(1),
                "bias must be float32 with one value per output feature");
    bias_data = bias->data_ptr<float>();
  }
  auto out = at::empty(acc.sizes(), acc.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_rows",
                                  [&] { dequantize_rows_impl<scalar_t>(acc, scale, bias_data, out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("dequantize_rows(Tensor acc, Tensor scale, Tensor? bias, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(actorserve, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("dequantize_rows", &dequantize_rows);
}
