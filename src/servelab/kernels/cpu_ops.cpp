// Fused elementwise ops and paged decode attention for the CPU fast path.
// Activations are fp32; the KV cache is bf16, fp32 or int8 (kv_cache.h). Shapes are noted per op.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kv_cache.h"
#include "ops.h"
#include "rowops.h"

namespace servelab {
namespace {

using rowops::decode_attention_heads;
using rowops::load8;
using rowops::norm_row;
using rowops::write_cache;

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, name, ": fp32 (rows, n) with unit stride");
  TORCH_CHECK(x.size(1) % 8 == 0, name, ": row length must be a multiple of 8");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = x.size(0), n = x.size(1);
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(x.data_ptr<float>() + r * x.stride(0), w, out.data_ptr<float>() + r * n, n, eps);
  });
  return out;
}

void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes(), "add_rms_norm_: shapes");
  const int64_t rows = x.size(0), n = x.size(1);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* xr = xp + r * n;
      float* rr = rp + r * n;
      for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(rr + i, _mm256_add_ps(load8(rr + i), load8(xr + i)));
      norm_row(rr, w, xr, n, eps);
    }
  });
}

// qkv: (T, (H + 2 * KVH) * hd) fp32; cos, sin: (max_positions, hd) fp32 (the two halves repeat);
// kv_cache: (2, num_blocks, block_size, KVH, row) (kv_cache.h). Rotates q and k in place (rotate-half layout).
void rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t num_heads, int64_t num_kv_heads, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  check_rows(qkv, "rope_and_cache_");
  TORCH_CHECK(qkv.is_contiguous() && kv_cache.is_contiguous(), "rope_and_cache_: contiguous inputs");
  const int64_t T = qkv.size(0), hd = kv_head_dim(kv_cache), row = qkv.size(1);
  const int64_t kv_size = num_kv_heads * hd, token_stride = num_kv_heads * kv_cache.size(4);
  const int64_t cache_half = kv_cache.numel() / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  float* base = qkv.data_ptr<float>();
  dispatch_kv(kv_cache.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* k_cache = kv_data<scalar_t>(kv_cache);
    scalar_t* v_cache = k_cache + cache_half;
    at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* c = cos.data_ptr<float>() + pos[t] * hd;
        const float* s = sin.data_ptr<float>() + pos[t] * hd;
        float* tok = base + t * row;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) rowops::rope_rotate(tok + h * hd, c, s, hd);
        const float* k = tok + num_heads * hd;
        write_cache(k_cache + slots[t] * token_stride, k, num_kv_heads, hd);
        write_cache(v_cache + slots[t] * token_stride, k + kv_size, num_kv_heads, hd);
      }
    });
  });
}

// q: (D, H * hd) fp32 rows (any row stride); block_tables: (D, max_blocks) int64; context_lens: (D,) int64.
// prefetch: tensors read next (the following matrices), prefetched in slices by the attention tasks.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t num_heads,
                                  const std::vector<at::Tensor>& prefetch) {
  check_rows(q, "paged_decode_attention");
  const int64_t D = q.size(0), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3), hd = kv_head_dim(kv_cache);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(q.size(1) == num_heads * hd && hd % 8 == 0, "paged_decode_attention: q shape");
  auto out = at::empty({D, num_heads * hd}, q.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t cache_half = kv_cache.numel() / 2;
  std::vector<rowops::SidePrefetch::Region> regions;
  int64_t side_lines = 0;
  for (const auto& t : prefetch) {
    TORCH_CHECK(t.is_contiguous(), "paged_decode_attention: prefetch tensors must be contiguous");
    regions.push_back({static_cast<const char*>(t.data_ptr()), (t.nbytes() + 63) / 64});
    side_lines += regions.back().lines;
  }
  // task i of n prefetches its share of the side lines
  auto side = [&](int64_t i, int64_t n) { return rowops::SidePrefetch(&regions, side_lines * i / n, side_lines * (i + 1) / n); };
  dispatch_kv(kv_cache.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* k_cache = kv_data<scalar_t>(kv_cache);
    const scalar_t* v_cache = k_cache + cache_half;
    const float* qp = q.data_ptr<float>();
    float* op = out.data_ptr<float>();
    if (D >= 2 * at::get_num_threads()) {
      // One task per sequence: a token's K and V rows are read whole, across all KV heads.
      at::parallel_for(0, D, 1, [&](int64_t b, int64_t e) {
        std::vector<float> scores;
        std::vector<const scalar_t*> rows;
        for (int64_t seq = b; seq < e; ++seq) {
          if (seq + 1 < e)
            rowops::prefetch_context_start(k_cache, tables + (seq + 1) * max_blocks, lens[seq + 1], block_size,
                                           num_kv_heads * kv_cache.size(4));
          decode_attention_heads(qp + seq * q.stride(0), k_cache, v_cache, tables + seq * max_blocks, lens[seq],
                                 block_size, num_kv_heads, hd, group, 0, num_kv_heads, scale,
                                 op + seq * num_heads * hd, scores, rows, side(seq, D));
        }
      });
      return;
    }
    // Few sequences: one task per (sequence, KV head), so that every thread has work.
    at::parallel_for(0, D * num_kv_heads, 1, [&](int64_t b, int64_t e) {
      std::vector<float> scores;
      std::vector<const scalar_t*> rows;
      for (int64_t task = b; task < e; ++task) {
        const int64_t seq = task / num_kv_heads, h = task % num_kv_heads;
        decode_attention_heads(qp + seq * q.stride(0), k_cache, v_cache, tables + seq * max_blocks, lens[seq],
                               block_size, num_kv_heads, hd, group, h, h + 1, scale, op + seq * num_heads * hd,
                               scores, rows, side(task, D * num_kv_heads));
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  const int64_t inter = x.size(-1) / 2;
  return at::silu(x.narrow(-1, 0, inter)).mul_(x.narrow(-1, inter, inter));
}

}  // namespace servelab
