// servelab's CPU ops: the decode hot path fused into a handful of calls per layer.
#pragma once
#include <ATen/ATen.h>

#include <vector>

namespace servelab {

at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t num_heads, int64_t num_kv_heads, at::Tensor& kv_cache, const at::Tensor& slot_mapping);
// prefetch: tensors that run next (a W8A8 layer's matrices), prefetched while attention computes.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t num_heads,
                                  const std::vector<at::Tensor>& prefetch);
// q (T, H * hd) fp32 rows of prefill chunks c starting at row starts[c] (num_tokens[c] rows, after
// num_computed[c] cached tokens), block_tables (C, max_blocks): causal attention (prefill_attention.cpp).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& starts,
                             const at::Tensor& num_tokens, const at::Tensor& num_computed,
                             const at::Tensor& block_tables, int64_t num_heads);
at::Tensor silu_and_mul(const at::Tensor& x);
// x (M, K) fp32 @ W.T with W (N, row bytes) uint8 in GGUF blocks of ggml type `type` (linear_quant.cpp).
// int8_inputs: up to 4 rows of x (memory-bound steps) are rounded to 8 bits per 32 values first, as
// llama.cpp does (quant_blocks.h's Q8Input), and multiplied in integers; more rows run in fp32.
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& w, int64_t type, bool int8_inputs);
at::Tensor dequantize_gguf(const at::Tensor& w, int64_t type, int64_t K);
// W8A8 around torch._int_mm (int8_rows.cpp): x (M, K) fp32, times inv_smooth (K,) if given, to int8 rows
// with one scale each ({q (M, K) int8, scales (M, 1) fp32}); acc (M, N) int32 * row_scales * col_scales -> fp32.
// a (M <= 16, K) int8 @ w (N, K) int8 -> (M, N) int32, as torch._int_mm(a, w.t()) gives it, for a's values in
// [-127, 127] (int8_gemm_rows.cpp: the few rows of a decode step).
at::Tensor int8_matmul_rows(const at::Tensor& a, const at::Tensor& w);
std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x, const c10::optional<at::Tensor>& inv_smooth);
at::Tensor dequantize_rows_int32(const at::Tensor& acc, const at::Tensor& row_scales, const at::Tensor& col_scales);
// Per row, the first index of the largest dequantize_rows_int32 value: greedy tokens from LM-head accumulators.
at::Tensor argmax_rows_int32(const at::Tensor& acc, const at::Tensor& row_scales, const at::Tensor& col_scales);
// gate_up's int32 accumulators (M, 2I) -> silu(gate) * up, times inv_smooth (I,) if given, as int8 rows
// with one scale each: the MLP middle of W8A8 without fp32 intermediates.
std::vector<at::Tensor> silu_mul_quantize_int8(const at::Tensor& acc, const at::Tensor& row_scales,
                                               const at::Tensor& col_scales, const c10::optional<at::Tensor>& inv_smooth);
// acc (M, N) int32 de-quantized, added into residual in place, RMS-normed with weight and quantized (times
// inv_smooth (N,) if given): {q (M, N) int8, scales (M, 1)}, as dequantize_rows_int32, add_rms_norm_ and
// quantize_rows_int8 in a row, bit for bit.
std::vector<at::Tensor> dequant_add_rms_norm_quantize_int8(const at::Tensor& acc, const at::Tensor& row_scales,
                                                           const at::Tensor& col_scales, at::Tensor& residual,
                                                           const at::Tensor& weight, double eps,
                                                           const c10::optional<at::Tensor>& inv_smooth);

// A W8A8 model's decode-only step (no prefill rows) through every layer, as llama.py's forward_w8a8 runs it
// layer by layer (w8a8_layers.cpp). x: the embeddings (T, hidden) fp32, also the residual, updated in place;
// layers: per layer {input_norm, post_norm, then for qkv, o, gate_up, down: int8 weight (N, K), scales (N,),
// inverse smoothing (K,) or an empty tensor}. Returns the last down_proj's {acc, row scales, column scales}
// and the residual. prefetch_weights: each layer's attention prefetches the matrices that run after it;
// int_mm_min_rows: from how many rows a GEMM goes to at::_int_mm (quantization.py's INT_MM_MIN_ROWS).
std::vector<at::Tensor> w8a8_decode_layers(const at::Tensor& x, const std::vector<std::vector<at::Tensor>>& layers,
                                           const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                                           int64_t num_heads, int64_t num_kv_heads,
                                           const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                                           const at::Tensor& block_tables, const at::Tensor& context_lens, double eps,
                                           bool prefetch_weights, int64_t int_mm_min_rows);

// A Llama-family decoder (bf16 or GGUF weights, bf16 or int8 KV cache) run one token of one sequence at a time:
// forward() is the whole decode step up to the final norm, in one parallel region, and logits()
// the LM head (decode_step.cpp). It streams its own packed copy of bf16 matrices (gemv.h), or a
// GGUF-quantized matrix's blocks as stored (quant_blocks.h).
class DecodeRunner {
 public:
  static constexpr int64_t BF16 = 30;  // ggml's id; the other weight types are quant_blocks.h's
  // embed, lm_head: (vocab, hidden) of their types; final_norm: fp32; cos, sin: (max_positions, head_dim) fp32.
  // int8_inputs: GGUF matrices multiply inputs rounded to 8 bits (linear_gguf's int8_inputs).
  DecodeRunner(at::Tensor embed, int64_t embed_type, at::Tensor lm_head, int64_t lm_head_type, at::Tensor final_norm,
               at::Tensor cos, at::Tensor sin, int64_t num_heads, int64_t num_kv_heads, double eps, bool int8_inputs);
  // Norms and bias fp32; matrices with q|k|v and gate|up fused, as the model stores them; types: of
  // qkv, o, gate_up, down.
  void add_layer(at::Tensor input_norm, at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, at::Tensor o,
                 at::Tensor post_norm, at::Tensor gate_up, at::Tensor down, std::vector<int64_t> types);
  // Writes this token's k, v at slot of every layer's cache; returns the final-normed hidden (1, hidden).
  at::Tensor forward(int64_t token, int64_t position, int64_t slot, const at::Tensor& block_table,
                     const std::vector<at::Tensor>& kv_caches);
  // hidden: (1, hidden) fp32 -> (1, vocab) fp32.
  at::Tensor logits(const at::Tensor& hidden);

 private:
  struct Layer {
    at::Tensor input_norm, qkv, qkv_bias, o, post_norm, gate_up, down;
    int64_t qkv_type, o_type, gate_up_type, down_type;
  };
  at::Tensor embed_, lm_head_, final_norm_, cos_, sin_;
  int64_t embed_type_, lm_head_type_;
  int64_t num_heads_, num_kv_heads_, hidden_, head_dim_;
  double eps_;
  bool int8_inputs_;
  std::vector<Layer> layers_;
};

}  // namespace servelab
