// Argument checks shared by the kernels that read the paged KV pool.
#pragma once

#include <ATen/ATen.h>

#include "kv_rows.h"

namespace actorserve {

constexpr int64_t MAX_HEAD_DIM = 256;

// q: [tokens, heads, dim], each token's heads contiguous (q may be a view of a fused qkv
// projection); k_pool, v_pool: [slots, kv_heads, dim] in q's dtype, or [slots, kv_heads, dim + 4]
// int8 rows with their scales (kv_rows.h); req_to_token: [rows, context].
inline void check_paged_inputs(const char* kernel, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                               const at::Tensor& req_to_token) {
  TORCH_CHECK(q.device().is_cpu(), kernel, " runs on a CPU");
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "q, k_pool and v_pool must be 3-dimensional");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads must be contiguous within each token");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "k_pool and v_pool must be contiguous");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type() && (k_pool.scalar_type() == q.scalar_type() || int8_rows(k_pool)),
              "the pools must hold q's dtype or int8 rows");
  const int64_t row = int8_rows(k_pool) ? q.size(2) + kRowScaleBytes : q.size(2);
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.size(2) == row, "pool shapes do not match q");
  TORCH_CHECK(q.size(1) % k_pool.size(1) == 0, "query heads must be a multiple of K/V heads");
  TORCH_CHECK(q.size(2) <= MAX_HEAD_DIM, "head dim ", q.size(2), " is over the kernels' ", MAX_HEAD_DIM);
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.stride(1) == 1, "req_to_token must be int32 with contiguous rows");
}

}  // namespace actorserve
