#include <torch/extension.h>
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16w", &servelab::linear_bf16w, "x @ w.T with bf16 w, fp32 x and y",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &servelab::rms_norm, "RMSNorm of fp32 rows with fp32 weight",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_rms_norm_", &servelab::add_rms_norm_, "residual += x; x = rms_norm(residual) (in place)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rope_and_cache_", &servelab::rope_and_cache_, "rotate q, k in qkv (in place); write k, v to the KV cache",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("paged_decode_attention", &servelab::paged_decode_attention, "one query token per sequence over paged KV",
        pybind11::arg("q"), pybind11::arg("kv_cache"), pybind11::arg("block_tables"), pybind11::arg("context_lens"),
        pybind11::arg("num_heads"), pybind11::arg("prefetch") = std::vector<at::Tensor>{},
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("prefill_attention", &servelab::prefill_attention,
        "causal attention of prefill chunks over their paged context (fp32 q rows, bf16 or fp32 cache)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_and_mul", &servelab::silu_and_mul, "silu(x[:, :I]) * x[:, I:]",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_gguf", &servelab::linear_gguf, "x @ w.T with w in GGUF quantized blocks, fp32 x and y",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("type"), pybind11::arg("int8_inputs") = false,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_gguf", &servelab::dequantize_gguf, "GGUF quantized blocks (N, row bytes) to fp32 (N, K)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_matmul_rows", &servelab::int8_matmul_rows, "a (M <= 16, K) int8 @ w (N, K).T int8 -> int32",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("quantize_rows_int8", &servelab::quantize_rows_int8, "fp32 rows (times 1 / smoothing) to int8, one scale each",
        pybind11::arg("x"), pybind11::arg("inv_smooth") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_rows_int32", &servelab::dequantize_rows_int32, "int32 (M, N) * row scales * column scales",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("argmax_rows_int32", &servelab::argmax_rows_int32,
        "per row, the first index of the largest int32 * row scale * column scale (greedy tokens)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_mul_quantize_int8", &servelab::silu_mul_quantize_int8,
        "gate_up's int32 accumulators to silu(gate) * up as int8 rows (times 1 / smoothing), one scale each",
        pybind11::arg("acc"), pybind11::arg("row_scales"), pybind11::arg("col_scales"),
        pybind11::arg("inv_smooth") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequant_add_rms_norm_quantize_int8", &servelab::dequant_add_rms_norm_quantize_int8,
        "int32 accumulators de-quantized, added into residual, RMS-normed and quantized to int8 rows in one pass",
        pybind11::arg("acc"), pybind11::arg("row_scales"), pybind11::arg("col_scales"), pybind11::arg("residual"),
        pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("inv_smooth") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("w8a8_decode_layers", &servelab::w8a8_decode_layers,
        "a W8A8 model's decode-only step through every layer in one call (llama.py's forward_w8a8, layer by layer)",
        pybind11::arg("x"), pybind11::arg("layers"), pybind11::arg("positions"), pybind11::arg("cos"),
        pybind11::arg("sin"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("kv_caches"),
        pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("context_lens"),
        pybind11::arg("eps"), pybind11::arg("prefetch_weights"), pybind11::arg("int_mm_min_rows"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<servelab::DecodeRunner>(m, "DecodeRunner", "one sequence's decode step in one call")
      .def(pybind11::init<at::Tensor, int64_t, at::Tensor, int64_t, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t,
                          double, bool>())
      .def("add_layer", &servelab::DecodeRunner::add_layer)
      .def("forward", &servelab::DecodeRunner::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("logits", &servelab::DecodeRunner::logits, pybind11::call_guard<pybind11::gil_scoped_release>());
}
