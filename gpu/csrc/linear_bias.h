// The optional bias of the linear-layer kernels (int8_matmul.cpp, gguf_matmul.cpp), checked.
#pragma once

#include <ATen/ATen.h>

namespace actorserve {

// The bias's float32 values, one per output feature, or nullptr for none.
inline const float* bias_data(const c10::optional<at::Tensor>& bias, int64_t out_features) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out_features,
              "bias must be float32 with one value per output feature");
  return bias->data_ptr<float>();
}

}  // namespace actorserve
