// Every decoder layer of a decode batch in one call, on a CPU.
//
// At batch 1 a decode step of SmolLM2-135M is ~450 kernel calls (30 layers of norms, four
// matmuls, RoPE, the KV write and attention), and through Python each call costs several times
// what the kernel does with one token: ~3.5 ms of a 13 ms int8 step went to the calls around the
// kernels. `DecodeLayers` holds every layer's weights and makes the same calls from C++, in the
// same order, on the same kernels (gpu/csrc/elementwise.cpp, decode_attention.cpp, and for the
// linear layers int8_matmul.cpp, gguf_matmul.cpp or oneDNN's packed linear, through the
// dispatcher), so its result is gpu/models.py's, bit for bit (tests/test_cpu_decode.py).
// gpu/cpu_decode.py builds it and decides when a batch takes it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "quantize_row.h"

#include <tuple>
#include <vector>

namespace {

using actorserve::kZeroPoint;

// One linear layer of gpu/packed_linear.py. A PackedLinear: `onednn` (oneDNN's packed weight) and
// `bias`. An Int8Linear: `scale` per output row and either `kernel` and `offsets` in int8_matmul's
// layout (CPUs with AVX512-VNNI or AVX2) or oneDNN's prepacked int8 `onednn` weight with its `zero_point`s.
// A GgufLinear: `kernel` its packed blocks, `offsets` and `scale` their float16 scales and minimums,
// `code_bits` the bits of its weights' codes.
struct LinearWeights {
  at::Tensor kernel, offsets, scale;
  c10::optional<at::Tensor> bias;
  at::Tensor onednn, zero_point;
  int64_t out_features, code_bits;
};

struct LayerWeights {
  at::Tensor input_norm, post_norm;
  LinearWeights qkv, o, gate_up, down;
};

// oneDNN's linear ops take a list of optional scalars, which has no plain C++ signature to look
// them up by: they are called boxed.
at::Tensor call_boxed(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

// Int8Linear's row buckets (gpu/packed_linear.py's row_bucket): oneDNN builds an int8 primitive
// per row count, so rows are padded to powers of two up to kRowStep, then to its multiples.
constexpr int64_t kRowStep = 128;
int64_t row_bucket(int64_t rows) {
  if (rows > kRowStep) return (rows + kRowStep - 1) / kRowStep * kRowStep;
  int64_t bucket = 1;
  while (bucket < rows) bucket *= 2;
  return bucket;
}

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNorm = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SiluMul = at::Tensor(const at::Tensor&);
using Rope = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Quantize = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&);
using Dequantize = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, at::ScalarType);
using GgufMatmul = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, int64_t, int64_t);
using Int8Matmul = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, int64_t);
using WriteKV = void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using DecodeAttention = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, double);

constexpr int64_t kPerLinear = 6;                  // kernel, offsets, scale, bias, onednn, zero_point (empty: none)
constexpr int64_t kPerLayer = 2 + 4 * kPerLinear;  // the two norms' weights, then qkv, o, gate_up, down

// gpu/cpu_decode.py's LINEAR_KINDS: which class of gpu/packed_linear.py every linear layer is.
enum class LinearKind : int64_t { kPacked = 0, kInt8 = 1, kGguf = 2 };

class DecodeLayers : public torch::CustomClassHolder {
 public:
  // weights: kPerLayer tensors per layer; out_features: qkv, o, gate_up, down per layer; code_bits:
  // the same for gguf layers (empty for the other kinds). dims: num_heads, num_kv_heads, head_dim;
  // numbers: rms eps, attention scale. kind: a LinearKind.
  DecodeLayers(int64_t kind, std::vector<at::Tensor> weights, std::vector<int64_t> out_features, std::vector<int64_t> code_bits,
               std::vector<int64_t> dims, std::vector<double> numbers, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_pools,
               std::vector<at::Tensor> v_pools)
      : kind_(static_cast<LinearKind>(kind)), cos_(std::move(cos)), sin_(std::move(sin)), k_pools_(std::move(k_pools)), v_pools_(std::move(v_pools)) {
    TORCH_CHECK(kind >= 0 && kind <= 2, "kind must be 0 (packed), 1 (int8) or 2 (gguf)");
    TORCH_CHECK(dims.size() == 3 && numbers.size() == 2, "dims: heads, kv heads, head dim; numbers: eps, scale");
    TORCH_CHECK(weights.size() % kPerLayer == 0 && out_features.size() == 4 * (weights.size() / kPerLayer),
                "weights and out_features do not describe whole layers");
    TORCH_CHECK(code_bits.size() == (kind == 2 ? out_features.size() : 0), "code_bits: one per gguf linear layer");
    const size_t layers = weights.size() / kPerLayer;
    TORCH_CHECK(k_pools_.size() == layers && v_pools_.size() == layers, "one K and one V pool per layer");
    heads_ = dims[0], kv_heads_ = dims[1], head_dim_ = dims[2];
    eps_ = numbers[0], scale_ = numbers[1];
    for (size_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights.data() + l * kPerLayer;
      const int64_t* out = out_features.data() + l * 4;
      auto linear = [&](int64_t i) {
        const at::Tensor* t = w + 2 + i * kPerLinear;
        const int64_t bits = code_bits.empty() ? 0 : code_bits[l * 4 + i];
        return LinearWeights{t[0], t[1], t[2], t[3].numel() == 0 ? c10::nullopt : c10::optional<at::Tensor>(t[3]), t[4], t[5], out[i], bits};
      };
      layers_.push_back(LayerWeights{w[0], w[1], linear(0), linear(1), linear(2), linear(3)});
    }
  }

  // hidden [batch, hidden] in place: every layer applied. positions, out_loc, req_rows, key_begin,
  // key_end: int64 [batch]; each request's new K/V goes to its out_loc slot and it attends to
  // positions key_begin .. key_end - 1 of its req_to_token row.
  void run(at::Tensor hidden, at::Tensor positions, at::Tensor out_loc, at::Tensor req_to_token, at::Tensor req_rows,
           at::Tensor key_begin, at::Tensor key_end) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be a contiguous [batch, hidden] tensor");
    static const auto rms_norm = find_op<RmsNorm>("actorserve::rms_norm");
    static const auto add_rms_norm = find_op<AddRmsNorm>("actorserve::add_rms_norm_");
    static const auto silu_mul = find_op<SiluMul>("actorserve::silu_mul");
    static const auto rope = find_op<Rope>("actorserve::rope_");
    static const auto matmul = find_op<Int8Matmul>("actorserve::int8_matmul");
    static const auto gguf_matmul = find_op<GgufMatmul>("actorserve::gguf_matmul");
    static const auto quantize = find_op<Quantize>("actorserve::quantize_rows");
    static const auto dequantize = find_op<Dequantize>("actorserve::dequantize_rows");
    static const auto onednn = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    static const auto onednn_int8 = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
    static const auto attention = find_op<DecodeAttention>("actorserve::decode_attention");
    static const auto write_kv = find_op<WriteKV>("actorserve::write_kv_");
    const int64_t batch = hidden.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const c10::List<c10::optional<at::Scalar>> no_args;
    auto linear = [&](const at::Tensor& x, const LinearWeights& w) {
      if (kind_ == LinearKind::kPacked) return call_boxed(onednn, {x, w.onednn, w.bias, "none", no_args, ""});
      if (kind_ == LinearKind::kGguf) return gguf_matmul.call(x, w.kernel, w.offsets, w.scale, w.bias, w.out_features, w.code_bits);
      if (w.kernel.numel() > 0) return matmul.call(x, w.kernel, w.offsets, w.scale, w.bias, w.out_features);
      // Int8Linear.forward's oneDNN path: the padding rows are the zero point, and integer dot
      // products are exact, so no row's result depends on them.
      auto [q, row_scale] = quantize.call(x);
      const int64_t padded = row_bucket(batch);
      if (padded != batch) q = at::cat({q, at::full({padded - batch, q.size(1)}, kZeroPoint, q.options())});
      const at::Tensor product = call_boxed(onednn_int8, {q, 1.0, kZeroPoint, w.onednn, w.scale, w.zero_point, c10::nullopt, 1.0, 0,
                                                          at::kFloat, "none", no_args, ""});
      return dequantize.call(product.narrow(0, 0, batch), row_scale, w.bias, x.scalar_type());
    };
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      const at::Tensor qkv = linear(rms_norm.call(hidden, w.input_norm, eps_), w.qkv);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({batch, heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({batch, kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({batch, kv_heads_, head_dim_});
      rope.call(q, positions, cos_, sin_);
      rope.call(k, positions, cos_, sin_);
      write_kv.call(k_pools_[l], v_pools_[l], out_loc, k, v);
      const at::Tensor attended = std::get<0>(
          attention.call(q.contiguous(), k_pools_[l], v_pools_[l], req_to_token, req_rows, key_begin, key_end, scale_));
      const at::Tensor delta = linear(attended.view({batch, q_size}), w.o);
      const at::Tensor normed = add_rms_norm.call(hidden, delta, w.post_norm, eps_);
      hidden.add_(linear(silu_mul.call(linear(normed, w.gate_up)), w.down));
    }
  }

 private:
  LinearKind kind_;
  std::vector<LayerWeights> layers_;
  at::Tensor cos_, sin_;
  std::vector<at::Tensor> k_pools_, v_pools_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  double eps_ = 0, scale_ = 0;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<int64_t, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>,
                       at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("run", &DecodeLayers::run);
}
