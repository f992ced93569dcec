// y = x @ W.T with W kept in GGUF's quantized blocks (quant_blocks.h) and fp32 x, y.
//
// Up to FEW_ROWS rows of x (decode steps: memory-bound) every sub-block of W is widened in
// registers and used for all of them, so W is read once from memory. Past that (prefill chunks,
// big decode batches: compute-bound) each task de-quantizes a tile of N_TILE rows of W into an fp32
// buffer that stays in L2 and runs a register-blocked fp32 micro-kernel over all rows of x, so the
// de-quantization is paid once per weight, not once per row of x.
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "quant_blocks.h"

namespace servelab {
namespace {

constexpr int64_t FEW_ROWS = 4;
constexpr int MB = 4, NB = 3;  // fp32 micro-tile: 12 accumulators + 3 weights + 1 x of 16 ymm
constexpr int64_t N_TILE = 24;  // 24 rows x 1536 columns of fp32 = 144 KiB

template <int mb, int nb>
inline void micro_tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0,
                       int64_t w_row0) {
  __m256 acc[mb][nb];
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < nb; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[nb];
    for (int j = 0; j < nb; ++j) wv[j] = _mm256_loadu_ps(w + (n0 - w_row0 + j) * K + k);
    for (int i = 0; i < mb; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < nb; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mb; ++i)
    for (int j = 0; j < nb; ++j) y[(m0 + i) * N + n0 + j] = quant::hsum(acc[i][j]);
}

template <int mb>
inline void row_block(const float* x, const float* tile, float* y, int64_t K, int64_t N, int64_t m0,
                      int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + NB <= n_end; n += NB) micro_tile<mb, NB>(x, tile, y, K, N, m0, n, n_begin);
  for (; n < n_end; ++n) micro_tile<mb, 1>(x, tile, y, K, N, m0, n, n_begin);
}

// f(std::integral_constant<int, M>{}) for 1 <= M <= FEW_ROWS.
template <typename F>
void with_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

void few_rows(int64_t type, const uint8_t* w, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  std::vector<float> sums(M * (K / quant::SUB));
  const float* xs[FEW_ROWS];
  const float* ss[FEW_ROWS];
  float* ys[FEW_ROWS];
  for (int64_t i = 0; i < M; ++i) {
    quant::subblock_sums(x + i * K, K, sums.data() + i * (K / quant::SUB));
    xs[i] = x + i * K, ss[i] = sums.data() + i * (K / quant::SUB), ys[i] = y + i * N;
  }
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    with_rows(M, [&](auto mb) { quant::rows<decltype(mb)::value>(type, w, K, xs, ss, ys, b, e); });
  });
}

// few_rows() with each row of x rounded to 8 bits per sub-block first (quant_blocks.h's Q8Input).
void few_rows_int8(int64_t type, const uint8_t* w, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t num_sub = K / quant::SUB;
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * num_sub), s(M * num_sub);
  quant::Q8Input xs[FEW_ROWS];
  float* ys[FEW_ROWS];
  for (int64_t i = 0; i < M; ++i) {
    quant::quantize_input(x + i * K, K, q.data() + i * K, d.data() + i * num_sub, s.data() + i * num_sub);
    xs[i] = {q.data() + i * K, d.data() + i * num_sub, s.data() + i * num_sub}, ys[i] = y + i * N;
  }
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    with_rows(M, [&](auto mb) { quant::int8_rows<decltype(mb)::value>(type, w, K, xs, ys, b, e); });
  });
}

void tiled(int64_t type, const uint8_t* w, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t num_tiles = (N + N_TILE - 1) / N_TILE;
  at::parallel_for(0, num_tiles, 1, [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> tile(N_TILE * K);
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n_begin = t * N_TILE, n_end = std::min(N, n_begin + N_TILE);
      quant::dequantize_rows(type, w, K, n_begin, n_end, tile.data());
      int64_t m = 0;
      for (; m + MB <= M; m += MB) row_block<MB>(x, tile.data(), y, K, N, m, n_begin, n_end);
      switch (M - m) {
        case 3: row_block<3>(x, tile.data(), y, K, N, m, n_begin, n_end); break;
        case 2: row_block<2>(x, tile.data(), y, K, N, m, n_begin, n_end); break;
        case 1: row_block<1>(x, tile.data(), y, K, N, m, n_begin, n_end); break;
        default: break;
      }
    }
  });
}

void check_blocks(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(quant::supported(type), "GGUF type ", type, " is not supported (Q4_0, Q4_1, Q8_0, Q4_K are)");
  TORCH_CHECK(K % quant::block_values(type) == 0, "columns must be a multiple of the block size");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                  w.size(1) == quant::row_bytes(type, K), "blocks must be contiguous uint8 (N, row bytes)");
}

}  // namespace

at::Tensor linear_gguf(const at::Tensor& x_in, const at::Tensor& w, int64_t type, bool int8_inputs) {
  TORCH_CHECK(x_in.dim() == 2, "linear_gguf: x must be (M, K)");
  auto x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_blocks(w, type, K);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (M <= FEW_ROWS && int8_inputs)
    few_rows_int8(type, wp, x.data_ptr<float>(), M, K, N, y.data_ptr<float>());
  else if (M <= FEW_ROWS)
    few_rows(type, wp, x.data_ptr<float>(), M, K, N, y.data_ptr<float>());
  else
    tiled(type, wp, x.data_ptr<float>(), M, K, N, y.data_ptr<float>());
  return y;
}

at::Tensor dequantize_gguf(const at::Tensor& w, int64_t type, int64_t K) {
  check_blocks(w, type, K);
  auto out = at::empty({w.size(0), K}, at::kFloat);
  at::parallel_for(0, w.size(0), 64, [&](int64_t b, int64_t e) {
    quant::dequantize_rows(type, w.data_ptr<uint8_t>(), K, b, e, out.data_ptr<float>() + b * K);
  });
  return out;
}

}  // namespace servelab
