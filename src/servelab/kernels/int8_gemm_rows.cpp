// int8 x int8 -> int32 for the few rows of a decode step (W8A8, --quantization int8). torch._int_mm wants
// more than 16 rows, and at a decode step's handful it streams the weights at a fraction of the memory's
// speed (padded to 17 rows: ~15 ms for the default model's 106 M layer weights on two Zen 4 cores, where
// reading them takes ~3). Here each weight row is read once, in 32-byte pieces, for all rows of a: the
// products are vpmaddubsw of |w| with a's values carrying w's sign (vpsignb), pairs summed to int32 by
// vpmaddwd. Exact (every pair sum fits int16 when a's values are in [-127, 127], which servelab's
// quantizing passes guarantee), so the result is _int_mm's, bit for bit.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "ops.h"
#include "simd.h"

namespace servelab {
namespace {

constexpr int64_t MAX_ROWS = 16;
constexpr int MB = 4;  // rows of a per pass over a weight row (held in L1 meanwhile)

// out[i * N + n] = a_i . w_n for rows i in [i0, i0 + mb) of a, one weight row n.
template <int mb>
inline void dot_rows(const int8_t* a, const int8_t* w, int64_t K, int64_t N, int64_t i0, int64_t n, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[mb];
  for (int i = 0; i < mb; ++i) acc[i] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256i w_abs = _mm256_sign_epi8(wv, wv);
    for (int i = 0; i < mb; ++i) {
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + (i0 + i) * K + k));
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(av, wv)), ones));
    }
  }
  for (int i = 0; i < mb; ++i) {
    int32_t sum = simd::hsum_epi32(acc[i]);
    for (int64_t kk = k; kk < K; ++kk) sum += static_cast<int32_t>(a[(i0 + i) * K + kk]) * w[kk];
    out[(i0 + i) * N + n] = sum;
  }
}

}  // namespace

at::Tensor int8_matmul_rows(const at::Tensor& a, const at::Tensor& w) {
  TORCH_CHECK(a.scalar_type() == at::kChar && w.scalar_type() == at::kChar && a.dim() == 2 && w.dim() == 2 &&
                  a.is_contiguous() && w.is_contiguous() && a.size(1) == w.size(1),
              "int8_matmul_rows: a (M, K) and w (N, K), contiguous int8");
  const int64_t M = a.size(0), K = a.size(1), N = w.size(0);
  TORCH_CHECK(M <= MAX_ROWS, "int8_matmul_rows: at most ", MAX_ROWS, " rows of a (torch._int_mm takes more)");
  auto out = at::empty({M, N}, a.options().dtype(at::kInt));
  if (M == 0 || N == 0) return out;
  const int8_t* ap = a.data_ptr<int8_t>();
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* row = wp + n * K;
      if (n + 1 < end) _mm_prefetch(reinterpret_cast<const char*>(row + K), _MM_HINT_T0);
      int64_t i = 0;
      for (; i + MB <= M; i += MB) dot_rows<MB>(ap, row, K, N, i, n, op);
      switch (M - i) {
        case 3: dot_rows<3>(ap, row, K, N, i, n, op); break;
        case 2: dot_rows<2>(ap, row, K, N, i, n, op); break;
        case 1: dot_rows<1>(ap, row, K, N, i, n, op); break;
        default: break;
      }
    }
  });
  return out;
}

}  // namespace servelab
