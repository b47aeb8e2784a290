// Every decoder layer of a decode batch in one call, on a CPU.
//
// At batch 1 a decode step of SmolLM2-135M is ~450 kernel calls (30 layers of norms, four
// matmuls, RoPE, the KV write and attention), and through Python each call costs several times
// what the kernel does with one token: ~3.5 ms of a 13 ms int8 step went to the calls around the
// kernels. `DecodeLayers` holds every layer's weights and makes the same calls from C++, in the
// same order, on the same kernels (gpu/csrc/elementwise.cpp, decode_attention.cpp, and for the
// linear layers int8_matmul.cpp or oneDNN's packed linear, through the dispatcher), so its result
// is gpu/models.py's, bit for bit (tests/test_cpu_decode.py). gpu/cpu_decode.py builds it and
// decides when a batch takes it.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace {

// One linear layer of gpu/packed_linear.py: an Int8Linear's weights in int8_matmul's layout
// (packed, offsets, scale), or a PackedLinear's weight in oneDNN's (packed; offsets and scale unused).
struct LinearWeights {
  at::Tensor packed, offsets, scale;
  c10::optional<at::Tensor> bias;
  int64_t out_features;
};

struct LayerWeights {
  at::Tensor input_norm, post_norm;
  LinearWeights qkv, o, gate_up, down;
};

// The schema of oneDNN's linear has a list of optional scalars, which has no plain C++ signature
// to look it up by: it is called boxed.
at::Tensor onednn_linear(const c10::OperatorHandle& op, const at::Tensor& x, const LinearWeights& w) {
  torch::jit::Stack stack{x, w.packed, w.bias, "none", c10::List<c10::optional<at::Scalar>>(), "" };
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNorm = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SiluMul = at::Tensor(const at::Tensor&);
using Rope = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using Int8Matmul = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const c10::optional<at::Tensor>&, int64_t);
using WriteKV = void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using DecodeAttention = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, double);

constexpr int64_t kPerLinear = 4;                  // packed, offsets, scale (empty for oneDNN's), bias (empty: none)
constexpr int64_t kPerLayer = 2 + 4 * kPerLinear;  // the two norms' weights, then qkv, o, gate_up, down

class DecodeLayers : public torch::CustomClassHolder {
 public:
  // weights: kPerLayer tensors per layer; out_features: qkv, o, gate_up, down per layer.
  // dims: num_heads, num_kv_heads, head_dim; numbers: rms eps, attention scale. int8: the linear
  // layers are Int8Linears (int8_matmul), else PackedLinears (oneDNN).
  DecodeLayers(bool int8, std::vector<at::Tensor> weights, std::vector<int64_t> out_features, std::vector<int64_t> dims,
               std::vector<double> numbers, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_pools,
               std::vector<at::Tensor> v_pools)
      : int8_(int8), cos_(std::move(cos)), sin_(std::move(sin)), k_pools_(std::move(k_pools)), v_pools_(std::move(v_pools)) {
    TORCH_CHECK(dims.size() == 3 && numbers.size() == 2, "dims: heads, kv heads, head dim; numbers: eps, scale");
    TORCH_CHECK(weights.size() % kPerLayer == 0 && out_features.size() == 4 * (weights.size() / kPerLayer),
                "weights and out_features do not describe whole layers");
    const size_t layers = weights.size() / kPerLayer;
    TORCH_CHECK(k_pools_.size() == layers && v_pools_.size() == layers, "one K and one V pool per layer");
    heads_ = dims[0], kv_heads_ = dims[1], head_dim_ = dims[2];
    eps_ = numbers[0], scale_ = numbers[1];
    for (size_t l = 0; l < layers; ++l) {
      const at::Tensor* w = weights.data() + l * kPerLayer;
      const int64_t* out = out_features.data() + l * 4;
      auto linear = [&](int64_t i) {
        const at::Tensor* t = w + 2 + i * kPerLinear;
        return LinearWeights{t[0], t[1], t[2], t[3].numel() == 0 ? c10::nullopt : c10::optional<at::Tensor>(t[3]), out[i]};
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
    static const auto onednn = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    static const auto attention = find_op<DecodeAttention>("actorserve::decode_attention");
    static const auto write_kv = find_op<WriteKV>("actorserve::write_kv_");
    const int64_t batch = hidden.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    auto linear = [&](const at::Tensor& x, const LinearWeights& w) {
      return int8_ ? matmul.call(x, w.packed, w.offsets, w.scale, w.bias, w.out_features) : onednn_linear(onednn, x, w);
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
  bool int8_;
  std::vector<LayerWeights> layers_;
  at::Tensor cos_, sin_;
  std::vector<at::Tensor> k_pools_, v_pools_;
  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  double eps_ = 0, scale_ = 0;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(actorserve, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<bool, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>, at::Tensor,
                       at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("run", &DecodeLayers::run);
}
