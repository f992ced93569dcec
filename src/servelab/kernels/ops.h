// servelab's CPU ops: the decode hot path fused into a handful of calls per layer.
#pragma once
#include <ATen/ATen.h>

namespace servelab {

at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t num_heads, int64_t num_kv_heads, at::Tensor& kv_cache, const at::Tensor& slot_mapping);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t num_heads);
at::Tensor silu_and_mul(const at::Tensor& x);

}  // namespace servelab
