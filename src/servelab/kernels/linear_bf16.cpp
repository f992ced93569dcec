// y = x @ w.T (+ bias) with bf16 weights and fp32 activations, for AVX2 + FMA CPUs.
//
// PyTorch's CPU bf16 GEMM falls back to a slow path where the CPU lacks AVX512-BF16/AMX, and its
// fp32 GEMM is tuned for square matrices, not the skinny x of a decode step. This kernel streams
// each weight tile from memory once, widens bf16 to fp32 in registers (a 16-bit shift), and reuses
// it for every row of x while it sits in L1/L2: memory-bound at batch 1, compute-bound at batch 100+.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

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

// ---- single-row path (decode of one sequence): memory-bound, so it is all about streaming w.
// A 32-byte load holds 16 bf16; in each 32-bit lane the even element is the low half, so
// (v << 16) is the even elements as fp32 and (v & 0xFFFF0000) the odd ones: two ALU ops widen 16
// weights, against x split once into its even and odd elements. Prefetching the next rows keeps
// enough lines in flight for one core to pull ~8 GB/s, twice what the plain loop reaches.
constexpr int GEMV_ROWS = 4;

void gemv_row(const float* x_even, const float* x_odd, const uint16_t* w, float* y, int64_t N, int64_t K) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  at::parallel_for(0, N / GEMV_ROWS, 16, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const uint16_t* rows = w + t * GEMV_ROWS * K;
      __m256 even[GEMV_ROWS], odd[GEMV_ROWS];
      for (int j = 0; j < GEMV_ROWS; ++j) even[j] = odd[j] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        for (int j = 0; j < GEMV_ROWS; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(rows + (j + GEMV_ROWS) * K + k), _MM_HINT_T0);
        const __m256 xe = _mm256_loadu_ps(x_even + k / 2), xo = _mm256_loadu_ps(x_odd + k / 2);
        for (int j = 0; j < GEMV_ROWS; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + j * K + k));
          even[j] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), even[j]);
          odd[j] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(v, high)), odd[j]);
        }
      }
      for (int j = 0; j < GEMV_ROWS; ++j) y[t * GEMV_ROWS + j] = hsum(_mm256_add_ps(even[j], odd[j]));
    }
  });
  for (int64_t n = N / GEMV_ROWS * GEMV_ROWS; n < N; ++n) {  // leftover rows
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s += (k % 2 ? x_odd : x_even)[(k / 16) * 8 + (k % 16) / 2] * bf16_to_float(w[n * K + k]);
    y[n] = s;
  }
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
  if (M == 1 && K % 16 == 0) {
    auto pairs = x.view({K / 16, 8, 2});
    auto x_even = pairs.select(2, 0).contiguous(), x_odd = pairs.select(2, 1).contiguous();
    gemv_row(x_even.data_ptr<float>(), x_odd.data_ptr<float>(), wp, yp, N, K);
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
