// y = x @ w.T (+ bias) with bf16 weights and fp32 activations, for AVX2 + FMA CPUs.
//
// PyTorch's CPU bf16 GEMM falls back to a slow path where the CPU lacks AVX512-BF16/AMX, and its
// fp32 GEMM is tuned for square matrices, not the skinny x of a decode step. This kernel streams
// each weight tile from memory once, widens bf16 to fp32 in registers (a 16-bit shift), and reuses
// it for every row of x while it sits in L1/L2: memory-bound at batch 1, compute-bound at batch 100+.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "gemv.h"
#include "ops.h"
#include "simd.h"

namespace servelab {
namespace {

constexpr int MB = 4;        // rows of x per micro-tile
constexpr int NB = 3;        // rows of w per micro-tile: 12 accumulators + 3 weights + 1 x = 16 ymm
constexpr int N_TILE = 48;   // rows of w per thread task (48 * K * 2 bytes stays in L2)

using simd::bf16_to_float;
using simd::hsum;
using simd::load_bf16x8;

// Computes y[m0:m0+mb, n0:n0+nb] for mb <= MB, nb <= NB.
template <int mb, int nb>
inline void micro_tile(const float* x, const uint16_t* w, float* y, int64_t K, int64_t N,
                       int64_t m0, int64_t n0) {
  __m256 acc[mb][nb];
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < nb; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[nb];
    for (int j = 0; j < nb; ++j) wv[j] = load_bf16x8(w + (n0 + j) * K + k);
    for (int i = 0; i < mb; ++i) {
      __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < nb; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mb; ++i) {
    for (int j = 0; j < nb; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t kk = k; kk < K; ++kk) s += x[(m0 + i) * K + kk] * bf16_to_float(w[(n0 + j) * K + kk]);
      y[(m0 + i) * N + n0 + j] = s;
    }
  }
}

template <int mb>
inline void row_block(const float* x, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t m0,
                      int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) micro_tile<mb, NB>(x, w, y, K, N, m0, n);
  for (; n < n_end; ++n) micro_tile<mb, 1>(x, w, y, K, N, m0, n);
}

}  // namespace

at::Tensor linear_bf16w(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2, "linear_bf16w: x (M, K) and w (N, K)");
  TORCH_CHECK(w_in.scalar_type() == at::kBFloat16, "linear_bf16w: w must be bfloat16");
  auto x = x_in.to(at::kFloat).contiguous();
  auto w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "linear_bf16w: shape mismatch");
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  if (M == 1 && K % 16 == 0) {  // one row: stream w (gemv.h)
    std::vector<float> x_even(K / 2), x_odd(K / 2);
    gemv::split_even_odd(xp, K, x_even.data(), x_odd.data());
    at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) { gemv::rows(x_even.data(), x_odd.data(), wp, K, yp, b, e); });
    if (bias.has_value()) y.add_(bias->to(at::kFloat));
    return y;
  }
  const int64_t num_tiles = (N + N_TILE - 1) / N_TILE;
  at::parallel_for(0, num_tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n_begin = t * N_TILE, n_end = std::min(N, n_begin + N_TILE);
      int64_t m = 0;
      for (; m + MB <= M; m += MB) row_block<MB>(xp, wp, yp, K, N, m, n_begin, n_end);
      switch (M - m) {
        case 3: row_block<3>(xp, wp, yp, K, N, m, n_begin, n_end); break;
        case 2: row_block<2>(xp, wp, yp, K, N, m, n_begin, n_end); break;
        case 1: row_block<1>(xp, wp, yp, K, N, m, n_begin, n_end); break;
        default: break;
      }
    }
  });
  if (bias.has_value()) y.add_(bias->to(at::kFloat));
  return y;
}

}  // namespace servelab
