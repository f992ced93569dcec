// Row-level building blocks shared by the fused CPU ops (cpu_ops.cpp) and the single-sequence
// decode step (decode_step.cpp). Activations are fp32; K/V rows are fp32 or bf16.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

namespace servelab::rowops {

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

template <typename T>
inline void write_cache(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// e^x for 8 floats: Cephes' expf (range reduction by ln 2, degree-6 polynomial), within 2 ulp of
// std::exp; x is clamped to [-87.3, 88.3], where the result stays a normal float.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n ln 2, ln 2 split in two parts
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// gate[i] = silu(gate[i]) * up[i].
inline void silu_mul(float* gate, const float* up, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// Rotates one head in place (rotate-half layout); c, s: this position's cos, sin (hd each).
inline void rope_rotate(float* x, const float* c, const float* s, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i + half] + x1 * s[i + half];
  }
}

// One KV head's query group of one sequence: softmax(q k^T * scale) v over its paged context.
template <typename T>
inline void decode_attention_task(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
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

}  // namespace servelab::rowops
