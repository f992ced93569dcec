// Causal attention of prefill chunks over their paged context (cached tokens, then the chunk itself), for
// the fused CPU path. PyTorch's scaled_dot_product_attention reaches ~25 GFLOP/s on SmolLM2's 128-token
// chunks (9 heads of 64 over 2 threads); this kernel tiles the two products as small GEMMs instead:
//   phase 1, per (chunk, KV head): the context's K rows as fp32 K^T (head_dim x context, padded to 16
//            keys) and V rows as fp32 (context x head_dim), read from the bf16, fp32 or int8 cache once
//            (an int8 row times its scale);
//   phase 2, per (chunk, KV head, query head of its group, 16 query rows): scores of 4 rows x 16 keys
//            per register tile, a softmax over each row's own keys (keys after a row's position are
//            skipped, not masked), then 4 rows x 16 values of P V per register tile.
// A row's result depends only on its own position's keys, in a fixed order, so it is the same however
// the prompt was chunked.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kv_cache.h"
#include "ops.h"
#include "rowops.h"

namespace servelab {
namespace {

constexpr int64_t KEY_TILE = 16;  // keys per score tile: two vectors
constexpr int64_t ROW_TILE = 4;   // query rows per register tile
constexpr int64_t ROWS_PER_TASK = 16;

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// s[r][0..keys) = scale * q_r . k for the ROW_TILE rows q_r, keys a multiple of KEY_TILE (zero-padded K^T).
void score_tile(const float* const* q, const float* kt, int64_t ctx16, int64_t keys, int64_t hd, float scale,
                float* s, int64_t s_stride) {
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t k0 = 0; k0 < keys; k0 += KEY_TILE) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t d = 0; d < hd; ++d) {
      const float* col = kt + d * ctx16 + k0;
      const __m256 k0v = _mm256_loadu_ps(col), k1v = _mm256_loadu_ps(col + 8);
      __m256 b = _mm256_broadcast_ss(q[0] + d);
      a00 = _mm256_fmadd_ps(b, k0v, a00);
      a01 = _mm256_fmadd_ps(b, k1v, a01);
      b = _mm256_broadcast_ss(q[1] + d);
      a10 = _mm256_fmadd_ps(b, k0v, a10);
      a11 = _mm256_fmadd_ps(b, k1v, a11);
      b = _mm256_broadcast_ss(q[2] + d);
      a20 = _mm256_fmadd_ps(b, k0v, a20);
      a21 = _mm256_fmadd_ps(b, k1v, a21);
      b = _mm256_broadcast_ss(q[3] + d);
      a30 = _mm256_fmadd_ps(b, k0v, a30);
      a31 = _mm256_fmadd_ps(b, k1v, a31);
    }
    _mm256_storeu_ps(s + k0, _mm256_mul_ps(a00, sc));
    _mm256_storeu_ps(s + k0 + 8, _mm256_mul_ps(a01, sc));
    _mm256_storeu_ps(s + s_stride + k0, _mm256_mul_ps(a10, sc));
    _mm256_storeu_ps(s + s_stride + k0 + 8, _mm256_mul_ps(a11, sc));
    _mm256_storeu_ps(s + 2 * s_stride + k0, _mm256_mul_ps(a20, sc));
    _mm256_storeu_ps(s + 2 * s_stride + k0 + 8, _mm256_mul_ps(a21, sc));
    _mm256_storeu_ps(s + 3 * s_stride + k0, _mm256_mul_ps(a30, sc));
    _mm256_storeu_ps(s + 3 * s_stride + k0 + 8, _mm256_mul_ps(a31, sc));
  }
}

// o_r[0..hd) = sum_j p[r][j] v_j for the ROW_TILE rows, over keys (a multiple of KEY_TILE; p is zero past a
// row's own keys, so the padding adds exact zeros). hd is a multiple of 16.
void value_tile(const float* p, int64_t p_stride, const float* v, int64_t keys, int64_t hd, float* const* o) {
  for (int64_t d0 = 0; d0 < hd; d0 += 16) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int64_t j = 0; j < keys; ++j) {
      const float* vj = v + j * hd + d0;
      const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
      __m256 b = _mm256_broadcast_ss(p + j);
      a00 = _mm256_fmadd_ps(b, v0, a00);
      a01 = _mm256_fmadd_ps(b, v1, a01);
      b = _mm256_broadcast_ss(p + p_stride + j);
      a10 = _mm256_fmadd_ps(b, v0, a10);
      a11 = _mm256_fmadd_ps(b, v1, a11);
      b = _mm256_broadcast_ss(p + 2 * p_stride + j);
      a20 = _mm256_fmadd_ps(b, v0, a20);
      a21 = _mm256_fmadd_ps(b, v1, a21);
      b = _mm256_broadcast_ss(p + 3 * p_stride + j);
      a30 = _mm256_fmadd_ps(b, v0, a30);
      a31 = _mm256_fmadd_ps(b, v1, a31);
    }
    _mm256_storeu_ps(o[0] + d0, a00);
    _mm256_storeu_ps(o[0] + d0 + 8, a01);
    _mm256_storeu_ps(o[1] + d0, a10);
    _mm256_storeu_ps(o[1] + d0 + 8, a11);
    _mm256_storeu_ps(o[2] + d0, a20);
    _mm256_storeu_ps(o[2] + d0 + 8, a21);
    _mm256_storeu_ps(o[3] + d0, a30);
    _mm256_storeu_ps(o[3] + d0 + 8, a31);
  }
}

struct Chunk {
  int64_t start, rows, computed, context, ctx16, scratch;  // scratch: offset of this chunk's K^T/V buffers
};

}  // namespace

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& starts,
                             const at::Tensor& num_tokens, const at::Tensor& num_computed,
                             const at::Tensor& block_tables, int64_t num_heads) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.stride(1) == 1, "prefill_attention: fp32 q rows");
  const int64_t T = q.size(0), block_size = kv_cache.size(2), kvh = kv_cache.size(3), hd = kv_head_dim(kv_cache);
  const int64_t group = num_heads / kvh, C = starts.numel(), max_blocks = block_tables.size(1);
  TORCH_CHECK(q.size(1) == num_heads * hd && hd % 16 == 0 && num_heads % kvh == 0, "prefill_attention: shapes");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous() && block_tables.size(0) == C,
              "prefill_attention: cache and block tables");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* nt = num_tokens.data_ptr<int64_t>();
  const int64_t* nc = num_computed.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  std::vector<Chunk> chunks(C);
  int64_t scratch = 0;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t context = nc[c] + nt[c];
    TORCH_CHECK(st[c] >= 0 && st[c] + nt[c] <= T && context <= max_blocks * block_size, "prefill_attention: chunk");
    chunks[c] = {st[c], nt[c], nc[c], context, round_up(context, KEY_TILE), scratch};
    scratch += kvh * 2 * chunks[c].ctx16 * hd;
  }
  std::vector<float> kv(scratch);  // per chunk and KV head: K^T (hd x ctx16), then V (ctx16 x hd)
  auto out = at::empty({T, num_heads * hd}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t cache_half = kv_cache.numel() / 2, head_stride = kv_cache.size(4), token_stride = kvh * head_stride;
  // Phase 1: the context of every (chunk, KV head), widened to fp32 and laid out for the tiles.
  dispatch_kv(kv_cache.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    using Row = rowops::KvRow<T_>;
    const T_* k_cache = kv_data<T_>(kv_cache);
    const T_* v_cache = k_cache + cache_half;
    at::parallel_for(0, C * kvh, 1, [&](int64_t b, int64_t e) {
      for (int64_t task = b; task < e; ++task) {
        const Chunk& ch = chunks[task / kvh];
        const int64_t h = task % kvh;
        float* kt = kv.data() + ch.scratch + h * 2 * ch.ctx16 * hd;
        float* v = kt + ch.ctx16 * hd;
        const int64_t* table = tables + (task / kvh) * max_blocks;
        for (int64_t pos = 0; pos < ch.context; ++pos) {
          const int64_t off =
              (table[pos / block_size] * block_size + pos % block_size) * token_stride + h * head_stride;
          // the row's scale: 1 for unscaled rows, where the product is the value itself
          const float ks = Row::scale(k_cache + off, hd), vs = Row::scale(v_cache + off, hd);
          for (int64_t d = 0; d < hd; ++d) {
            kt[d * ch.ctx16 + pos] = static_cast<float>(k_cache[off + d]) * ks;
            v[pos * hd + d] = static_cast<float>(v_cache[off + d]) * vs;
          }
        }
        for (int64_t pos = ch.context; pos < ch.ctx16; ++pos) {
          for (int64_t d = 0; d < hd; ++d) kt[d * ch.ctx16 + pos] = 0.f;
          std::fill(v + pos * hd, v + (pos + 1) * hd, 0.f);
        }
      }
    });
  });
  // Phase 2: tasks of ROWS_PER_TASK query rows of one query head of one chunk.
  std::vector<int64_t> task_start(C + 1, 0);
  for (int64_t c = 0; c < C; ++c)
    task_start[c + 1] = task_start[c] + num_heads * ((chunks[c].rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = q.stride(0), o_stride = num_heads * hd;
  at::parallel_for(0, task_start[C], 1, [&](int64_t b, int64_t e) {
    std::vector<float> s;
    for (int64_t task = b; task < e; ++task) {
      const int64_t c = std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1;
      const Chunk& ch = chunks[c];
      const int64_t blocks = (ch.rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK, local = task - task_start[c];
      const int64_t head = local / blocks, r_begin = (local % blocks) * ROWS_PER_TASK;
      const int64_t r_end = std::min(ch.rows, r_begin + ROWS_PER_TASK);
      const float* kt = kv.data() + ch.scratch + (head / group) * 2 * ch.ctx16 * hd;
      const float* v = kt + ch.ctx16 * hd;
      s.resize(ROW_TILE * ch.ctx16);
      for (int64_t r0 = r_begin; r0 < r_end; r0 += ROW_TILE) {
        const float* qr[ROW_TILE];
        float* orow[ROW_TILE];
        std::vector<float> spare;  // rows past the chunk's end compute into here (duplicates of its last row)
        int64_t last = r0;
        for (int64_t i = 0; i < ROW_TILE; ++i) {
          const int64_t r = std::min(r0 + i, r_end - 1);
          last = std::max(last, r);
          qr[i] = qp + (ch.start + r) * q_stride + head * hd;
          if (r0 + i < r_end) {
            orow[i] = op + (ch.start + r) * o_stride + head * hd;
          } else {
            if (spare.empty()) spare.resize(ROW_TILE * hd);
            orow[i] = spare.data() + i * hd;
          }
        }
        const int64_t keys = round_up(ch.computed + last + 1, KEY_TILE);
        score_tile(qr, kt, ch.ctx16, keys, hd, scale, s.data(), ch.ctx16);
        for (int64_t i = 0; i < ROW_TILE; ++i) {
          const int64_t own = ch.computed + std::min(r0 + i, r_end - 1) + 1;  // this row's keys: 0..position
          float* si = s.data() + i * ch.ctx16;
          rowops::softmax_inplace(si, own);
          std::fill(si + own, si + keys, 0.f);
        }
        value_tile(s.data(), ch.ctx16, v, keys, hd, orow);
      }
    }
  });
  return out;
}

}  // namespace servelab
