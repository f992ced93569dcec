// The two row passes around W8A8's int8 x int8 -> int32 matmul (torch._int_mm), each one pass over memory
// where PyTorch takes five (abs, amax, divide, round, clamp, cast) and three (cast, two multiplies).
// Same fp32 operations in the same order as quantization.py's reference, so the results are bit-identical:
// round-to-nearest-even is the default MXCSR mode that _mm256_cvtps_epi32 uses, as torch.round does.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "ops.h"
#include "rowops.h"

namespace servelab {
namespace {

constexpr int64_t GRAIN_ELEMENTS = 1 << 15;  // rows per task: at least this many values

int64_t row_grain(int64_t row_length) { return std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(1, row_length)); }

// x * inv_smooth (or x where there is no smoothing) into out; returns the row's max |value|.
float smooth_row(const float* x, const float* inv_smooth, float* out, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_loadu_ps(x + k);
    if (inv_smooth) v = _mm256_mul_ps(v, _mm256_loadu_ps(inv_smooth + k));
    _mm256_storeu_ps(out + k, v);
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, v));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = *std::max_element(lanes, lanes + 8);
  for (; k < K; ++k) {
    out[k] = inv_smooth ? x[k] * inv_smooth[k] : x[k];
    amax = std::max(amax, std::fabs(out[k]));
  }
  return amax;
}

// 32 int32 lanes (four vectors) saturated to 32 int8 in order: packs work per 128-bit lane, the permute restores it.
inline __m256i pack_int8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

void quantize_row(const float* xs, float scale, int8_t* q, int64_t K) {
  const __m256 vscale = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  auto convert = [&](int64_t k) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(xs + k), vscale), lo), hi);
    return _mm256_cvtps_epi32(v);
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), pack_int8(convert(k), convert(k + 8), convert(k + 16),
                                                                     convert(k + 24)));
  for (; k < K; ++k) q[k] = static_cast<int8_t>(std::nearbyint(std::clamp(xs[k] / scale, -127.0f, 127.0f)));
}

// A matrix's optional inverse SmoothQuant factors as fp32 (n,), or an undefined tensor where there are none.
at::Tensor smoothing(const c10::optional<at::Tensor>& inv_smooth, int64_t n, const char* op) {
  if (!inv_smooth.has_value()) return at::Tensor();
  auto smooth = inv_smooth->to(at::kFloat).contiguous();
  TORCH_CHECK(smooth.dim() == 1 && smooth.size(0) == n, op, ": inv_smooth must be (", n, ",)");
  return smooth;
}

inline const float* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// Eight int32 accumulators de-quantized: (acc * row scale) * column scale, the one fp32 order every op here
// uses (dequantize_rows_int32 writes these values; the fused passes and argmax_rows_int32 must see the same).
inline __m256 dequant8(const int32_t* acc, __m256 row_scale, const float* col_scales) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc)));
  return _mm256_mul_ps(_mm256_mul_ps(v, row_scale), _mm256_loadu_ps(col_scales));
}

// int32 accumulators (M, N) with their row scales (M,) and column scales (N,), contiguous fp32, as every op
// here reads them.
struct ScaledAcc {
  at::Tensor acc, rows, cols;
  int64_t M, N;
  const int32_t* ap() const { return acc.data_ptr<int32_t>(); }
  const float* rp() const { return rows.data_ptr<float>(); }
  const float* cp() const { return cols.data_ptr<float>(); }
};

ScaledAcc scaled_acc(const at::Tensor& acc, const at::Tensor& row_scales, const at::Tensor& col_scales, const char* op) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt, op, ": acc must be (M, N) int32");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(row_scales.numel() == M && col_scales.numel() == N, op, ": scales must be (M,) and (N,)");
  return {acc.contiguous(), row_scales.to(at::kFloat).contiguous(), col_scales.to(at::kFloat).contiguous(), M, N};
}

}  // namespace

std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x_in, const c10::optional<at::Tensor>& inv_smooth) {
  TORCH_CHECK(x_in.dim() == 2, "quantize_rows_int8: x must be (M, K)");
  auto x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor smooth = smoothing(inv_smooth, K, "quantize_rows_int8");
  const float* s = data_or_null(smooth);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto scales = at::empty({M, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, M, row_grain(K), [&](int64_t b, int64_t e) {
    std::vector<float> row(K);
    for (int64_t m = b; m < e; ++m) {
      const float scale = std::max(smooth_row(xp + m * K, s, row.data(), K), 1e-8f) / 127.0f;
      quantize_row(row.data(), scale, qp + m * K, K);
      sp[m] = scale;
    }
  });
  return {q, scales};
}

at::Tensor dequantize_rows_int32(const at::Tensor& acc, const at::Tensor& row_scales, const at::Tensor& col_scales) {
  const ScaledAcc in = scaled_acc(acc, row_scales, col_scales, "dequantize_rows_int32");
  const int64_t M = in.M, N = in.N;
  auto y = at::empty({M, N}, in.acc.options().dtype(at::kFloat));
  const int32_t* ap = in.ap();
  const float *rp = in.rp(), *cp = in.cp();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, row_grain(N), [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const __m256 r = _mm256_set1_ps(rp[m]);
      const int32_t* am = ap + m * N;
      float* ym = yp + m * N;
      int64_t n = 0;
      for (; n + 8 <= N; n += 8) _mm256_storeu_ps(ym + n, dequant8(am + n, r, cp + n));
      for (; n < N; ++n) ym[n] = static_cast<float>(am[n]) * rp[m] * cp[n];
    }
  });
  return y;
}

// W8A8's MLP middle in one pass per row: gate_up's int32 accumulators (M, 2I) de-quantized (the same
// (v * row) * column order as dequantize_rows_int32), silu(gate) * up (exp within 2 ulp of std::exp),
// times down_proj's inverse smoothing, then quantized as quantize_rows_int8 does. The fp32 (M, 2I) and
// (M, I) intermediates, 12 MB each for a 1,024-token step of SmolLM2, never reach memory.
std::vector<at::Tensor> silu_mul_quantize_int8(const at::Tensor& acc, const at::Tensor& row_scales,
                                               const at::Tensor& col_scales, const c10::optional<at::Tensor>& inv_smooth) {
  const ScaledAcc in = scaled_acc(acc, row_scales, col_scales, "silu_mul_quantize_int8");
  TORCH_CHECK(in.N % 2 == 0, "silu_mul_quantize_int8: acc must be (M, 2I): gate then up");
  const int64_t M = in.M, I = in.N / 2;
  const at::Tensor smooth = smoothing(inv_smooth, I, "silu_mul_quantize_int8");
  const float* sp = data_or_null(smooth);
  auto q = at::empty({M, I}, in.acc.options().dtype(at::kChar));
  auto scales = at::empty({M, 1}, in.acc.options().dtype(at::kFloat));
  const int32_t* ap = in.ap();
  const float *rp = in.rp(), *cp = in.cp();
  int8_t* qp = q.data_ptr<int8_t>();
  float* outs = scales.data_ptr<float>();
  at::parallel_for(0, M, row_grain(2 * I), [&](int64_t b, int64_t e) {
    std::vector<float> row(I);
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = b; m < e; ++m) {
      const float r = rp[m];
      const __m256 r8 = _mm256_set1_ps(r);
      const int32_t* gate = ap + m * 2 * I;
      const int32_t* up = gate + I;
      __m256 vmax = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 g = dequant8(gate + i, r8, cp + i), u = dequant8(up + i, r8, cp + I + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, rowops::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        __m256 h = _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
        if (sp) h = _mm256_mul_ps(h, _mm256_loadu_ps(sp + i));
        _mm256_storeu_ps(row.data() + i, h);
        vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, h));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmax);
      float amax = *std::max_element(lanes, lanes + 8);
      for (; i < I; ++i) {
        const float g = static_cast<float>(gate[i]) * r * cp[i], u = static_cast<float>(up[i]) * r * cp[I + i];
        float h = g / (1.f + std::exp(-g)) * u;
        if (sp) h *= sp[i];
        row[i] = h;
        amax = std::max(amax, std::fabs(h));
      }
      const float scale = std::max(amax, 1e-8f) / 127.0f;
      quantize_row(row.data(), scale, qp + m * I, I);
      outs[m] = scale;
    }
  });
  return {q, scales};
}

// The step between two W8A8 matrices in one pass per row: acc (M, N) int32 de-quantized as
// dequantize_rows_int32 does, added into residual (M, N) in place, RMS-normed with weight as add_rms_norm_
// does, then times inv_smooth and quantized as quantize_rows_int8 does; bit for bit the three calls in a
// row, without their fp32 (M, N) intermediates or two of their three parallel regions.
std::vector<at::Tensor> dequant_add_rms_norm_quantize_int8(const at::Tensor& acc, const at::Tensor& row_scales,
                                                           const at::Tensor& col_scales, at::Tensor& residual,
                                                           const at::Tensor& weight, double eps,
                                                           const c10::optional<at::Tensor>& inv_smooth) {
  const ScaledAcc in = scaled_acc(acc, row_scales, col_scales, "dequant_add_rms_norm_quantize_int8");
  const int64_t M = in.M, N = in.N;
  TORCH_CHECK(N % 8 == 0 && residual.is_contiguous() && residual.scalar_type() == at::kFloat &&
                  residual.sizes() == acc.sizes() && weight.numel() == N && weight.scalar_type() == at::kFloat,
              "dequant_add_rms_norm_quantize_int8: residual (M, N) and weight (N,) fp32, N a multiple of 8");
  auto w = weight.contiguous();
  const at::Tensor smooth = smoothing(inv_smooth, N, "dequant_add_rms_norm_quantize_int8");
  const float* sp = data_or_null(smooth);
  auto q = at::empty({M, N}, in.acc.options().dtype(at::kChar));
  auto scales = at::empty({M, 1}, in.acc.options().dtype(at::kFloat));
  const int32_t* ap = in.ap();
  const float *rp = in.rp(), *cp = in.cp();
  const float* wp = w.data_ptr<float>();
  float* res = residual.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* outs = scales.data_ptr<float>();
  at::parallel_for(0, M, row_grain(N), [&](int64_t b, int64_t e) {
    std::vector<float> row(N);
    for (int64_t m = b; m < e; ++m) {
      const __m256 r = _mm256_set1_ps(rp[m]);
      const int32_t* am = ap + m * N;
      float* rr = res + m * N;
      for (int64_t n = 0; n < N; n += 8) {
        __m256 y = dequant8(am + n, r, cp + n);
        asm("" : "+x"(y));  // keeps the compiler from contracting the product and the add into one FMA
        _mm256_storeu_ps(rr + n, _mm256_add_ps(_mm256_loadu_ps(rr + n), y));
      }
      rowops::norm_row(rr, wp, row.data(), N, eps);
      const float scale = std::max(smooth_row(row.data(), sp, row.data(), N), 1e-8f) / 127.0f;
      quantize_row(row.data(), scale, qp + m * N, N);
      outs[m] = scale;
    }
  });
  return {q, scales};
}

// Per row, the index of the largest acc * row_scale * col_scale, computed as dequantize_rows_int32 computes each
// value (the same two fp32 products), the first one where several are equal (as torch's and numpy's argmax):
// a greedy step's tokens from the LM head's accumulators, without writing and re-reading fp32 logits.
at::Tensor argmax_rows_int32(const at::Tensor& acc, const at::Tensor& row_scales, const at::Tensor& col_scales) {
  const ScaledAcc in = scaled_acc(acc, row_scales, col_scales, "argmax_rows_int32");
  const int64_t M = in.M, N = in.N;
  TORCH_CHECK(N > 0, "argmax_rows_int32: no columns");
  auto out = at::empty({M}, in.acc.options().dtype(at::kLong));
  const int32_t* ap = in.ap();
  const float *rp = in.rp(), *cp = in.cp();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const int32_t* am = ap + m * N;
      const __m256 r = _mm256_set1_ps(rp[m]);
      // each lane keeps its largest value and that value's first column (a later equal one does not replace it)
      __m256 best = _mm256_set1_ps(-INFINITY);
      __m256i best_col = _mm256_setzero_si256(), col = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      int64_t n = 0;
      for (; n + 8 <= N; n += 8) {
        const __m256 y = dequant8(am + n, r, cp + n);
        const __m256 greater = _mm256_cmp_ps(y, best, _CMP_GT_OQ);
        best = _mm256_blendv_ps(best, y, greater);
        best_col = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_col), _mm256_castsi256_ps(col), greater));
        col = _mm256_add_epi32(col, _mm256_set1_epi32(8));
      }
      alignas(32) float values[8];
      alignas(32) int32_t cols[8];
      _mm256_store_ps(values, best);
      _mm256_store_si256(reinterpret_cast<__m256i*>(cols), best_col);
      float top = -INFINITY;
      int64_t top_col = -1;
      for (int lane = 0; lane < 8 && n > 0; ++lane)
        if (values[lane] > top || (values[lane] == top && cols[lane] < top_col)) top = values[lane], top_col = cols[lane];
      for (; n < N; ++n) {
        const float y = static_cast<float>(am[n]) * rp[m] * cp[n];
        if (y > top || top_col < 0) top = y, top_col = n;
      }
      op[m] = top_col;
    }
  });
  return out;
}

}  // namespace servelab
