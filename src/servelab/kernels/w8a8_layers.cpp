// A W8A8 model's decode step through all its layers in one call: the same ops in the same order as
// LlamaDecoderLayer.forward_w8a8 (llama.py) runs them one Python call at a time, so the results are the same
// bit for bit. At batch 64 those ~11 calls a layer cost the step a few milliseconds of Python and dispatch
// while the second OpenMP thread waited.
#include <ATen/ATen.h>

#include "ops.h"

namespace servelab {
namespace {

// A matrix of one layer: int8 weight (N, K), per-row scales (N,), inverse smoothing (K,) or empty for none.
struct Int8Matrix {
  at::Tensor w, scale;
  c10::optional<at::Tensor> inv_smooth;
};

Int8Matrix matrix(const std::vector<at::Tensor>& t, size_t i) {
  return {t[i], t[i + 1], t[i + 2].numel() ? c10::optional<at::Tensor>(t[i + 2]) : c10::nullopt};
}

// int8_matmul (quantization.py): _int_mm from min_rows rows (its INT_MM_MIN_ROWS), servelab's few-row kernel below.
at::Tensor int8_matmul(const at::Tensor& a, const at::Tensor& w, int64_t min_rows) {
  return a.size(0) < min_rows ? int8_matmul_rows(a, w) : at::_int_mm(a, w.t());
}

}  // namespace

std::vector<at::Tensor> w8a8_decode_layers(const at::Tensor& x, const std::vector<std::vector<at::Tensor>>& layers,
                                           const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                                           int64_t num_heads, int64_t num_kv_heads,
                                           const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                                           const at::Tensor& block_tables, const at::Tensor& context_lens, double eps,
                                           bool prefetch_weights, int64_t int_mm_min_rows) {
  TORCH_CHECK(!layers.empty() && layers.size() == kv_caches.size(), "w8a8_decode_layers: one KV cache per layer");
  for (const auto& t : layers) TORCH_CHECK(t.size() == 14, "w8a8_decode_layers: 14 tensors a layer");
  at::Tensor residual = x;
  at::Tensor acc, h_scale, down_scale;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& t = layers[i];
    const at::Tensor &input_norm = t[0], &post_norm = t[1];
    const Int8Matrix qkv = matrix(t, 2), o = matrix(t, 5), gate_up = matrix(t, 8), down = matrix(t, 11);
    std::vector<at::Tensor> xq = i == 0 ? quantize_rows_int8(rms_norm(x, input_norm, eps), qkv.inv_smooth)
                                        : dequant_add_rms_norm_quantize_int8(acc, h_scale, down_scale, residual,
                                                                             input_norm, eps, qkv.inv_smooth);
    at::Tensor qkv_rows = dequantize_rows_int32(int8_matmul(xq[0], qkv.w, int_mm_min_rows), xq[1], qkv.scale);
    at::Tensor kv_cache = kv_caches[i];
    rope_and_cache_(qkv_rows, positions, cos, sin, num_heads, num_kv_heads, kv_cache, slot_mapping);
    const int64_t head_dim = qkv_rows.size(1) / (num_heads + 2 * num_kv_heads);
    // the matrices that run next, pulled into cache while attention computes (their GEMMs wait less on DRAM)
    std::vector<at::Tensor> prefetch;
    if (prefetch_weights) prefetch = {o.w, gate_up.w, down.w};
    if (prefetch_weights && i + 1 < layers.size()) prefetch.push_back(layers[i + 1][2]);
    at::Tensor attn = paged_decode_attention(qkv_rows.narrow(1, 0, num_heads * head_dim), kv_cache, block_tables,
                                             context_lens, num_heads, prefetch);
    std::vector<at::Tensor> aq = quantize_rows_int8(attn, o.inv_smooth);
    xq = dequant_add_rms_norm_quantize_int8(int8_matmul(aq[0], o.w, int_mm_min_rows), aq[1], o.scale, residual,
                                            post_norm, eps, gate_up.inv_smooth);
    std::vector<at::Tensor> hq = silu_mul_quantize_int8(int8_matmul(xq[0], gate_up.w, int_mm_min_rows), xq[1],
                                                        gate_up.scale, down.inv_smooth);
    acc = int8_matmul(hq[0], down.w, int_mm_min_rows);
    h_scale = hq[1];
    down_scale = down.scale;
  }
  return {acc, h_scale, down_scale, residual};
}

}  // namespace servelab
