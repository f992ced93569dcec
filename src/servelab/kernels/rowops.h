// Row-level building blocks shared by the fused CPU ops (cpu_ops.cpp) and the single-sequence
// decode step (decode_step.cpp). Activations are fp32; K/V rows are fp32, bf16 or int8 (KvInt8).
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace servelab::rowops {

// One value of an int8 KV cache (--kv-cache-dtype int8): each (token, KV head) row holds head_dim int8
// values, then their fp32 scale (max |x| / 127) in the next 4 bytes, so a row is head_dim + 4 bytes and a
// block carries its own scales (KV transfer and prefix sharing move blocks whole). A row's value is
// stored * scale; the kernels multiply by the scale once per score (K) or attention weight (V), not per value.
struct KvInt8 {
  int8_t v;
  explicit operator float() const { return v; }  // the stored value, before its row's scale
};

// Per-row layout of a KV cache element type: the extra elements after head_dim values, and the row's scale.
template <typename T>
struct KvRow {
  static constexpr bool scaled = false;
  static constexpr int64_t extra = 0;
  static float scale(const T*, int64_t) { return 1.f; }
};
template <>
struct KvRow<KvInt8> {
  static constexpr bool scaled = true;
  static constexpr int64_t extra = 4;
  static float scale(const KvInt8* row, int64_t head_dim) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof(s));
    return s;
  }
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return simd::load_bf16x8(reinterpret_cast<const uint16_t*>(p)); }
inline __m256 load8(const KvInt8* p) { return simd::load_i8x8(reinterpret_cast<const int8_t*>(p)); }
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

inline void norm_row(const float* r, const float* w, float* out, int64_t n, double eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = load8(r + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(hsum(acc) / n + eps)));
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(r + i), inv), load8(w + i)));
}

// Stores num_heads rows of head_dim values (src: the heads one after another) at dst, rows head_dim +
// KvRow<T>::extra apart. int8: scale = max |x| / 127 per row, value = round-half-even(x / scale), as
// model/attention.py's quantize_kv does (a row of zeros keeps scale 0).
template <typename T>
inline void write_cache(T* dst, const float* src, int64_t num_heads, int64_t head_dim) {
  for (int64_t i = 0; i < num_heads * head_dim; ++i) dst[i] = static_cast<T>(src[i]);
}
// Eight at a time where head_dim allows: the same division and round-half-even (_mm256_round_ps) per value.
inline void write_cache(KvInt8* dst, const float* src, int64_t num_heads, int64_t head_dim) {
  const bool vector = head_dim % 8 == 0;
  for (int64_t h = 0; h < num_heads; ++h, src += head_dim, dst += head_dim + KvRow<KvInt8>::extra) {
    float amax = 0.f;
    int64_t i = 0;
    if (vector) {
      __m256 m = _mm256_setzero_ps();
      for (; i < head_dim; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.f), _mm256_loadu_ps(src + i)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      amax = *std::max_element(lanes, lanes + 8);
    }
    for (; i < head_dim; ++i) amax = std::max(amax, std::fabs(src[i]));
    const float scale = amax / 127.f;
    i = 0;
    if (vector && scale != 0.f) {
      const __m256 vs = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
      for (; i < head_dim; i += 8) {
        const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src + i), vs),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i v = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packs_epi16(w, w));
      }
    }
    for (; i < head_dim; ++i)
      dst[i].v = scale == 0.f ? 0 : static_cast<int8_t>(std::clamp(std::nearbyint(src[i] / scale), -127.f, 127.f));
    std::memcpy(dst + head_dim, &scale, sizeof(scale));
  }
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
  int64_t i = 0;
  if (half % 8 == 0)
    for (; i < half; i += 8) {
      const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + i + half);
      _mm256_storeu_ps(x + i, _mm256_fmsub_ps(x1, _mm256_loadu_ps(c + i), _mm256_mul_ps(x2, _mm256_loadu_ps(s + i))));
      _mm256_storeu_ps(x + i + half, _mm256_fmadd_ps(x2, _mm256_loadu_ps(c + i + half),
                                                     _mm256_mul_ps(x1, _mm256_loadu_ps(s + i + half))));
    }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i + half] + x1 * s[i + half];
  }
}

// Dot products of NG query heads (q_g = q + g * n) with four K rows k[0..3], n a multiple of 8, written
// scaled as four floats to s + g * s_stride: each K row is widened once per 8 values for all NG heads
// (a GQA group reads its KV head once), in 4 * NG independent FMA chains reduced by one hadd tree per head.
template <int NG, typename T>
inline void dot4_group(const float* q, const T* const* k, int64_t n, float* s, int64_t s_stride, __m128 scale) {
  __m256 acc[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) {
    // One K row live at a time, q read from L1 by each FMA: 4 * NG accumulators + 1 stay within AVX2's 16
    // registers (holding four widened rows spilled accumulators to the stack).
    for (int j = 0; j < 4; ++j) {
      const __m256 kj = load8(k[j] + d);
      for (int g = 0; g < NG; ++g) acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * n + d), kj, acc[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    // [s0 s1 s2 s3] of the low 128-bit halves beside those of the high halves, then added.
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(s + g * s_stride, _mm_mul_ps(sum, scale));
  }
}

// Softmax of s[0..n) in place (vectorised max, exp and sum; exp8 is within 2 ulp of std::exp).
inline void softmax_inplace(float* s, int64_t n) {
  int64_t i = 0;
  __m256 mx8 = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(s + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, mx8);
  float mx = lanes[0];
  for (int k = 1; k < 8; ++k) mx = std::max(mx, lanes[k]);
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
    _mm256_storeu_ps(s + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum(sum8);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - mx));
  const float inv = 1.f / sum;
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv8));
  for (; i < n; ++i) s[i] *= inv;
}

// out_g[0..n) = sum_j w_g[j] * v_j[0..n) for NG query heads g sharing one KV head (w_g = w + g * w_stride,
// out_g = out + g * n): each V row is read once for all NG heads, 32 values at a time in 4 * NG registers.
// Per token the NG weights are broadcast first, then the row is widened 8 values at a time, each used by NG
// FMAs at once: 4 * NG + NG + 1 = 16 registers for NG = 3. Holding the row's four widened vectors instead
// needed 17, and the spilled accumulator's store-to-load round trip made every token wait on it.
// Scaled rows (KvInt8, n = head_dim): each weight takes its V row's scale first (w * scale, one fp32 product).
template <int NG, typename T>
inline void weighted_sum_group(const float* w, int64_t w_stride, const T* const* v, int64_t count, float* out,
                               int64_t n) {
  int64_t d0 = 0;
  for (; d0 + 32 <= n; d0 += 32) {
    __m256 acc[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j) {
      const T* vj = v[j] + d0;
      __m256 wj[NG];
      const float vs = KvRow<T>::scale(v[j], n);
      for (int g = 0; g < NG; ++g)
        wj[g] = KvRow<T>::scaled ? _mm256_set1_ps(w[g * w_stride + j] * vs) : _mm256_broadcast_ss(w + g * w_stride + j);
      for (int i = 0; i < 4; ++i) {
        const __m256 vi = load8(vj + 8 * i);
        for (int g = 0; g < NG; ++g) acc[g][i] = _mm256_fmadd_ps(wj[g], vi, acc[g][i]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + g * n + d0 + 8 * i, acc[g][i]);
  }
  for (; d0 < n; d0 += 8) {
    for (int g = 0; g < NG; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < count; ++j)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(w[g * w_stride + j] * KvRow<T>::scale(v[j], n)), load8(v[j] + d0), acc);
      _mm256_storeu_ps(out + g * n + d0, acc);
    }
  }
}

// Prefetch every cache line of [p, p + bytes); LOCALITY as __builtin_prefetch takes it (3: into L1, 2: into L2),
// the same on GCC and Clang.
template <int LOCALITY>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, LOCALITY);
}

// Calls f(std::integral_constant<int, NG>{}, g) for the query heads [g, g + NG) of one GQA group, NG = 3
// where it can (three heads' accumulators fill AVX2's 16 registers), then 2 or 1.
template <typename F>
inline void for_head_triples(int64_t group, F&& f) {
  for (int64_t g = 0; g < group;) {
    if (group - g >= 3) {
      f(std::integral_constant<int, 3>{}, g);
      g += 3;
    } else if (group - g == 2) {
      f(std::integral_constant<int, 2>{}, g);
      g += 2;
    } else {
      f(std::integral_constant<int, 1>{}, g);
      g += 1;
    }
  }
}

// Cache lines of other tensors (the matrices that run after attention) prefetched into this core's caches
// while attention computes: a W8A8 decode step's GEMMs otherwise wait for their weights to stream in from
// DRAM (at batch 64 the same GEMMs took ~30% longer from DRAM than from cache). Each attention task takes one slice of
// the lines [begin, end) of the regions laid end to end, and issues a few per step of its own work (next(n))
// rather than all at once, where they would fill the miss buffers and stall the attention's own loads.
// Off by default since the attention's K rows go to L2 (LlamaForCausalLM.prefetch_weights): the two then compete.
class SidePrefetch {
 public:
  struct Region {
    const char* data;
    int64_t lines;
  };
  SidePrefetch() = default;
  SidePrefetch(const std::vector<Region>* regions, int64_t begin, int64_t end)
      : regions_(regions), line_(begin), end_(end) {
    if (regions_ == nullptr || line_ >= end_) return;
    while (region_ < static_cast<int64_t>(regions_->size()) && line_ >= offset_ + (*regions_)[region_].lines)
      offset_ += (*regions_)[region_++].lines;
  }
  int64_t remaining() const { return end_ - line_; }
  // Prefetches up to n more lines of this task's slice (into L2: the L3 keeps what L2 evicts).
  void next(int64_t n) {
    for (; n > 0 && line_ < end_; --n, ++line_) {
      while (line_ >= offset_ + (*regions_)[region_].lines) offset_ += (*regions_)[region_++].lines;
      __builtin_prefetch((*regions_)[region_].data + (line_ - offset_) * 64, 0, 2);
    }
  }
  void finish() { next(end_ - line_); }

 private:
  const std::vector<Region>* regions_ = nullptr;
  int64_t line_ = 0, end_ = 0, region_ = 0, offset_ = 0;
};

// Decode attention prefetches K rows this many tokens ahead (blocks are scattered: the hardware cannot
// guess them); the caller prefetches the next sequence's first ones (prefetch_context_start). Into L2, not L1:
// a batch's KV comes from DRAM, and L2 tracks more misses in flight than L1 does. At batch 64 (int8 KV, 160
// tokens) one layer's attention took 0.30 -> 0.27 ms from DRAM, and the engine's decode step, alternating
// step by step, 49.31 -> 48.84 and 48.39 -> 47.62 ms; 16 or 64 tokens ahead did no better than 32.
constexpr int64_t kDecodePrefetchTokens = 32;

// Prefetches into L2 the first K rows (all KV heads) of a sequence's paged context.
template <typename T>
inline void prefetch_context_start(const T* k_cache, const int64_t* table, int64_t context, int64_t block_size,
                                   int64_t token_stride) {
  const int64_t bytes = token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t start = 0, block = 0; start < std::min(context, kDecodePrefetchTokens); start += block_size, ++block)
    for (int64_t i = 0, n = std::min(block_size, context - start); i < n; ++i)
      prefetch_bytes<2>(k_cache + (table[block] * block_size + i) * token_stride, bytes);
}

// Decode attention of one sequence's KV heads [h_begin, h_end) over its paged context: for each of
// their query heads (group per KV head), softmax(q k^T * scale) v. q, out: that sequence's
// num_kv_heads * group heads of head_dim. K is read four tokens at a time, token by token across the KV heads
// taken (a token's row is contiguous in the cache, so are a block's rows), each KV head's slice widened
// once for its whole query group; K rows are prefetched into L2 kDecodePrefetchTokens ahead, V rows
// for the second pass. Scaled rows (KvInt8): a score takes its K row's scale with the softmax scale, and
// the attention weights their V row's scale in the weighted sum. rows and scores are scratch; side:
// other tensors' lines to prefetch along the way (SidePrefetch).
template <typename T>
inline void decode_attention_heads(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                                   int64_t context, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t group, int64_t h_begin, int64_t h_end, float scale, float* out,
                                   std::vector<float>& scores, std::vector<const T*>& rows,
                                   SidePrefetch side = {}) {
  using Row = KvRow<T>;
  const int64_t head_stride = head_dim + Row::extra, token_stride = num_kv_heads * head_stride;
  const int64_t num_heads = (h_end - h_begin) * group;
  scores.resize(num_heads * context);
  rows.resize(2 * context);
  const T** k_rows = rows.data();
  const T** v_rows = rows.data() + context;
  for (int64_t start = 0, block = 0; start < context; start += block_size, ++block) {  // no division per token
    const int64_t base = table[block] * block_size * token_stride + h_begin * head_stride;
    for (int64_t i = 0, n = std::min(block_size, context - start); i < n; ++i) {
      k_rows[start + i] = k_cache + base + i * token_stride;
      v_rows[start + i] = v_cache + base + i * token_stride;
    }
  }
  q += h_begin * group * head_dim;
  out += h_begin * group * head_dim;
  const int64_t bytes = (h_end - h_begin) * head_stride * static_cast<int64_t>(sizeof(T));
  const __m128 scale4 = _mm_set1_ps(scale);
  for (int64_t p = 0; p < std::min(context, kDecodePrefetchTokens); ++p) prefetch_bytes<2>(k_rows[p], bytes);
  // the side lines spread over the QK groups, the rest before the V pass
  const int64_t side_per_group = (side.remaining() + context / 4) / (context / 4 + 1);
  int64_t pos = 0;
  for (; pos + 4 <= context; pos += 4) {
    side.next(side_per_group);
    for (int64_t j = 0; j < 4; ++j) prefetch_bytes<2>(v_rows[pos + j], bytes);
    const int64_t ahead = pos + kDecodePrefetchTokens;
    for (int64_t j = ahead; j < std::min(context, ahead + 4); ++j) prefetch_bytes<2>(k_rows[j], bytes);
    for (int64_t h = 0; h < h_end - h_begin; ++h) {
      const T* ptrs[4];
      for (int j = 0; j < 4; ++j) ptrs[j] = k_rows[pos + j] + h * head_stride;
      __m128 s4 = scale4;
      if constexpr (Row::scaled)
        s4 = _mm_mul_ps(s4, _mm_setr_ps(Row::scale(ptrs[0], head_dim), Row::scale(ptrs[1], head_dim),
                                        Row::scale(ptrs[2], head_dim), Row::scale(ptrs[3], head_dim)));
      for_head_triples(group, [&](auto ng, int64_t g) {
        const int64_t head = h * group + g;
        dot4_group<decltype(ng)::value>(q + head * head_dim, ptrs, head_dim, scores.data() + head * context + pos,
                                        context, s4);
      });
    }
  }
  for (; pos < context; ++pos)
    for (int64_t head = 0; head < num_heads; ++head) {
      const T* k = k_rows[pos] + (head / group) * head_stride;
      // as the four-token path: the sum times (softmax scale x row scale), the latter 1 for unscaled rows
      scores[head * context + pos] = dot(q + head * head_dim, k, head_dim) * (scale * Row::scale(k, head_dim));
    }
  side.finish();
  for (int64_t head = 0; head < num_heads; ++head) softmax_inplace(scores.data() + head * context, context);
  const T** hv = k_rows;  // the K row pointers are done with: reuse them for one KV head's V rows
  for (int64_t h = 0; h < h_end - h_begin; ++h) {
    for (int64_t p = 0; p < context; ++p) hv[p] = v_rows[p] + h * head_stride;
    for_head_triples(group, [&](auto ng, int64_t g) {
      weighted_sum_group<decltype(ng)::value>(scores.data() + (h * group + g) * context, context, hv, context,
                                              out + (h * group + g) * head_dim, head_dim);
    });
  }
}

}  // namespace servelab::rowops
