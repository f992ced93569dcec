// Fused elementwise ops and paged decode attention for the CPU fast path.
// Activations are fp32; the KV cache is bf16 or fp32. Shapes are noted per op.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace servelab {
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return simd::load_bf16x8(reinterpret_cast<const uint16_t*>(p)); }
using simd::hsum;

// n is a multiple of 8 (head_dim 64/128, hidden sizes): checked by the callers.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(load8(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i < n; i += 8) acc0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
  __m256 a = _mm256_set1_ps(alpha);
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, load8(x + i), load8(y + i)));
}

inline void norm_row(const float* r, const float* w, float* out, int64_t n, double eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = load8(r + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(hsum(acc) / n + eps)));
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(r + i), inv), load8(w + i)));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, name, ": fp32 (rows, n) with unit stride");
  TORCH_CHECK(x.size(1) % 8 == 0, name, ": row length must be a multiple of 8");
}

template <typename T>
void write_cache(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <typename T>
void decode_attention_task(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                           int64_t context, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                           int64_t group, int64_t kv_head, float scale, float* out, std::vector<float>& scores) {
  scores.resize(group * context);
  const int64_t token_stride = num_kv_heads * head_dim;
  for (int64_t pos = 0; pos < context; ++pos) {
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    const T* k = k_cache + slot * token_stride + kv_head * head_dim;
    for (int64_t g = 0; g < group; ++g) scores[g * context + pos] = dot(q + g * head_dim, k, head_dim) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * context;
    float mx = s[0];
    for (int64_t i = 1; i < context; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < context; ++i) sum += (s[i] = std::exp(s[i] - mx));
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < context; ++i) s[i] *= inv;
    std::memset(out + g * head_dim, 0, head_dim * sizeof(float));
  }
  for (int64_t pos = 0; pos < context; ++pos) {
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    const T* v = v_cache + slot * token_stride + kv_head * head_dim;
    for (int64_t g = 0; g < group; ++g) axpy(scores[g * context + pos], v, out + g * head_dim, head_dim);
  }
}

template <typename F>
void dispatch_kv(at::ScalarType type, F&& f) {
  if (type == at::kBFloat16) {
    f(c10::BFloat16{});
  } else if (type == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(false, "the KV cache must be float32 or bfloat16");
  }
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
// kv_cache: (2, num_blocks, block_size, KVH, hd). Rotates q and k in place (rotate-half layout).
void rope_and_cache_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t num_heads, int64_t num_kv_heads, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  check_rows(qkv, "rope_and_cache_");
  TORCH_CHECK(qkv.is_contiguous() && kv_cache.is_contiguous(), "rope_and_cache_: contiguous inputs");
  const int64_t T = qkv.size(0), hd = kv_cache.size(4), half = hd / 2, row = qkv.size(1);
  const int64_t kv_size = num_kv_heads * hd;
  const int64_t cache_half = kv_cache.numel() / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  float* base = qkv.data_ptr<float>();
  dispatch_kv(kv_cache.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
    scalar_t* v_cache = k_cache + cache_half;
    at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* c = cos.data_ptr<float>() + pos[t] * hd;
        const float* s = sin.data_ptr<float>() + pos[t] * hd;
        float* tok = base + t * row;
        for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
          float* x = tok + h * hd;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i + half] + x1 * s[i + half];
          }
        }
        const float* k = tok + num_heads * hd;
        write_cache(k_cache + slots[t] * kv_size, k, kv_size);
        write_cache(v_cache + slots[t] * kv_size, k + kv_size, kv_size);
      }
    });
  });
}

// q: (D, H * hd) fp32 rows (any row stride); block_tables: (D, max_blocks) int64; context_lens: (D,) int64.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, int64_t num_heads) {
  check_rows(q, "paged_decode_attention");
  const int64_t D = q.size(0), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3), hd = kv_cache.size(4);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(q.size(1) == num_heads * hd && hd % 8 == 0, "paged_decode_attention: q shape");
  auto out = at::empty({D, num_heads * hd}, q.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t cache_half = kv_cache.numel() / 2;
  dispatch_kv(kv_cache.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* k_cache = kv_cache.data_ptr<scalar_t>();
    const scalar_t* v_cache = k_cache + cache_half;
    at::parallel_for(0, D * num_kv_heads, 1, [&](int64_t b, int64_t e) {
      std::vector<float> scores;
      for (int64_t task = b; task < e; ++task) {
        const int64_t seq = task / num_kv_heads, h = task % num_kv_heads;
        decode_attention_task(q.data_ptr<float>() + seq * q.stride(0) + h * group * hd, k_cache, v_cache,
                              tables + seq * max_blocks, lens[seq], block_size, num_kv_heads, hd, group, h, scale,
                              out.data_ptr<float>() + seq * num_heads * hd + h * group * hd, scores);
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
