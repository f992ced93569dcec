// GGUF's quantized blocks, read as llama.cpp's dequantize_row_* reads them, one sub-block of 32
// values at a time: every supported format is, per 32 values, w = a * q + b with small integers q.
//   Q4_0  (18 B / 32):  fp16 d, 16 B nibbles (low nibbles = values 0-15)   a = d, b = -8 d
//   Q4_1  (20 B / 32):  fp16 d, fp16 m, nibbles as Q4_0                     a = d, b = m
//   Q8_0  (34 B / 32):  fp16 d, 32 int8                                     a = d, b = 0
//   Q4_K (144 B / 256): fp16 d, fp16 dmin, 12 B of 6-bit scales and mins, 128 B nibbles; in each
//                       64-value chunk the low nibbles of its 32 bytes are one sub-block, the high
//                       nibbles the next                                    a = d sc, b = -dmin m
// A row's dot product with x is then sum over sub-blocks of a (q . x_s) + b sum(x_s): the q are
// widened to fp32 in registers, and sum(x_s) is computed once per input row (subblock_sums).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace servelab::quant {

using simd::hsum;

// ggml's type ids, as the GGUF file stores them.
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12;
constexpr int64_t SUB = 32;  // values per sub-block

inline bool supported(int64_t type) { return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == Q4_K; }
inline int64_t block_values(int64_t type) { return type == Q4_K ? 256 : 32; }
inline int64_t block_bytes(int64_t type) {
  return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q8_0 ? 34 : 144;
}
inline int64_t row_bytes(int64_t type, int64_t K) { return K / block_values(type) * block_bytes(type); }

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256 u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 s8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
inline __m128i high8(__m128i v) { return _mm_srli_si128(v, 8); }

// The 32 q of one sub-block as four vectors of 8, with its a and b.
struct Sub {
  __m256 q[4];
  float a, b;
};

// Q4_K's 6-bit scale and min of sub-block j (0-7), ggml's get_scale_min_k4.
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Sub-block s (0-based within the row) of a row stored as `type` blocks.
inline Sub sub_block(int64_t type, const uint8_t* row, int64_t s) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  Sub out;
  if (type == Q8_0) {
    const uint8_t* b = row + s * 34;
    out.a = fp16(b);
    out.b = 0.f;
    const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    out.q[0] = s8x8(v0), out.q[1] = s8x8(high8(v0)), out.q[2] = s8x8(v1), out.q[3] = s8x8(high8(v1));
    return out;
  }
  if (type == Q4_K) {
    const uint8_t* b = row + (s / 8) * 144;
    const int j = static_cast<int>(s % 8);
    int sc, m;
    scale_min_k4(j, b + 4, sc, m);
    out.a = fp16(b) * sc;
    out.b = -fp16(b + 2) * m;
    const uint8_t* qs = b + 16 + (j / 2) * 32;
    __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
    if (j % 2) v0 = _mm_srli_epi16(v0, 4), v1 = _mm_srli_epi16(v1, 4);
    v0 = _mm_and_si128(v0, low4), v1 = _mm_and_si128(v1, low4);
    out.q[0] = u8x8(v0), out.q[1] = u8x8(high8(v0)), out.q[2] = u8x8(v1), out.q[3] = u8x8(high8(v1));
    return out;
  }
  const uint8_t* b = row + s * block_bytes(type);
  out.a = fp16(b);
  out.b = type == Q4_1 ? fp16(b + 2) : -8.f * out.a;
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (type == Q4_1 ? 4 : 2)));
  const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
  out.q[0] = u8x8(lo), out.q[1] = u8x8(high8(lo)), out.q[2] = u8x8(hi), out.q[3] = u8x8(high8(hi));
  return out;
}

// sums[s] = sum of x's sub-block s; K % 32 == 0.
inline void subblock_sums(const float* x, int64_t K, float* sums) {
  for (int64_t s = 0; s < K / SUB; ++s) {
    __m256 acc = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x + s * SUB), _mm256_loadu_ps(x + s * SUB + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(x + s * SUB + 16), _mm256_loadu_ps(x + s * SUB + 24)));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sums[s] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
}

// y[i][n] = row n . x[i] for mb input rows (x[i] of K values, x_sums[i] their subblock_sums), rows
// [n_begin, n_end) of W: each sub-block is widened once and used for all mb rows of x.
template <int mb>
inline void rows(int64_t type, const uint8_t* w, int64_t K, const float* const* x, const float* const* x_sums,
                 float* const* y, int64_t n_begin, int64_t n_end) {
  const int64_t stride = row_bytes(type, K), num_sub = K / SUB;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * stride;
    __m256 acc[mb];
    float offset[mb];
    for (int i = 0; i < mb; ++i) acc[i] = _mm256_setzero_ps(), offset[i] = 0.f;
    for (int64_t s = 0; s < num_sub; ++s) {
      if (s % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + (s + 16) * stride / num_sub, _MM_HINT_T0);
      const Sub sb = sub_block(type, row, s);
      const __m256 a = _mm256_set1_ps(sb.a);
      for (int i = 0; i < mb; ++i) {
        const float* xs = x[i] + s * SUB;
        __m256 t = _mm256_mul_ps(sb.q[0], _mm256_loadu_ps(xs));
        t = _mm256_fmadd_ps(sb.q[1], _mm256_loadu_ps(xs + 8), t);
        t = _mm256_fmadd_ps(sb.q[2], _mm256_loadu_ps(xs + 16), t);
        t = _mm256_fmadd_ps(sb.q[3], _mm256_loadu_ps(xs + 24), t);
        acc[i] = _mm256_fmadd_ps(a, t, acc[i]);
        offset[i] += sb.b * x_sums[i][s];
      }
    }
    for (int i = 0; i < mb; ++i) y[i][n] = hsum(acc[i]) + offset[i];
  }
}

// ---- Inputs rounded to 8 bits, as llama.cpp rounds them for its quantized dot products (Q8_1):
// per sub-block of 32 values d = max|x| / 127, q = round(x / d) (to nearest even), s = d sum(q), so
// x^ = d q. A row's product with x^ is then sum over sub-blocks of a d (q_w . q_x) + b s, where
// q_w . q_x is an integer dot product of 32 bytes (vpmaddubsw + vpmaddwd): a quarter of the
// instructions of widening every weight to fp32, which is what bounds a one-row product (rows()).
struct Q8Input {
  const int8_t* q;  // K values
  const float* d;   // K / 32 scales
  const float* s;   // K / 32 sums d sum(q)
};

// x (K fp32, K % 32 == 0) -> q, d, s as above.
inline void quantize_input(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t b = 0; b < K / SUB; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + b * SUB + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float db = _mm_cvtss_f32(m) / 127.f, inv = db != 0.f ? 1.f / db : 0.f;
    __m256i qi[4];
    for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * SUB), _mm256_permutevar8x32_epi32(packed, order));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    d[b] = db;
    s[b] = db * static_cast<float>(simd::hsum_epi32(total));
  }
}

// Sub-block s of a row as 32 bytes in value order (unsigned nibbles; signed for Q8_0), with a and b.
template <int64_t type>
inline __m256i int_sub_block(const uint8_t* row, int64_t s, float& a, float& b) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (type == Q8_0) {
    const uint8_t* blk = row + s * 34;
    a = fp16(blk), b = 0.f;
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else if constexpr (type == Q4_K) {
    const uint8_t* blk = row + (s / 8) * 144;
    const int j = static_cast<int>(s % 8);
    int sc, m;
    scale_min_k4(j, blk + 4, sc, m);
    a = fp16(blk) * sc, b = -fp16(blk + 2) * m;
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + (j / 2) * 32));
    if (j % 2) v = _mm256_srli_epi16(v, 4);
    return _mm256_and_si256(v, low4);
  } else {
    const uint8_t* blk = row + s * block_bytes(type);
    a = fp16(blk), b = type == Q4_1 ? fp16(blk + 2) : -8.f * a;
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (type == Q4_1 ? 4 : 2)));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);  // values 0-15, then 16-31
  }
}

// The 32-byte dot product q_w . q_x as 8 fp32 partial sums (exact: each pair sum fits int16).
template <int64_t type>
inline __m256 int_dot(__m256i w, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i pairs = type == Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                                     : _mm256_maddubs_epi16(w, x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// rows() against inputs rounded to 8 bits: y[i][n] = row n . x^[i]. Sub-blocks alternate between
// two sets of accumulators, so that one row's sums are two dependency chains.
template <int64_t type, int mb>
inline void int8_rows(const uint8_t* w, int64_t K, const Q8Input* x, float* const* y, int64_t n_begin,
                      int64_t n_end) {
  const int64_t stride = row_bytes(type, K), num_sub = K / SUB;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * stride;
    __m256 acc[2][mb];
    float offset[2][mb];
    for (int p = 0; p < 2; ++p)
      for (int i = 0; i < mb; ++i) acc[p][i] = _mm256_setzero_ps(), offset[p][i] = 0.f;
    for (int64_t s = 0; s < num_sub; ++s) {
      if (s % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(row) + (s + 16) * stride / num_sub, _MM_HINT_T0);
      const int p = static_cast<int>(s & 1);
      float a, b;
      const __m256i q = int_sub_block<type>(row, s, a, b);
      for (int i = 0; i < mb; ++i) {
        acc[p][i] = _mm256_fmadd_ps(_mm256_set1_ps(a * x[i].d[s]), int_dot<type>(q, x[i].q + s * SUB), acc[p][i]);
        if constexpr (type != Q8_0) offset[p][i] += b * x[i].s[s];
      }
    }
    for (int i = 0; i < mb; ++i) y[i][n] = hsum(_mm256_add_ps(acc[0][i], acc[1][i])) + offset[0][i] + offset[1][i];
  }
}

template <int mb>
inline void int8_rows(int64_t type, const uint8_t* w, int64_t K, const Q8Input* x, float* const* y, int64_t n_begin,
                      int64_t n_end) {
  switch (type) {
    case Q4_0: return int8_rows<Q4_0, mb>(w, K, x, y, n_begin, n_end);
    case Q4_1: return int8_rows<Q4_1, mb>(w, K, x, y, n_begin, n_end);
    case Q8_0: return int8_rows<Q8_0, mb>(w, K, x, y, n_begin, n_end);
    default: return int8_rows<Q4_K, mb>(w, K, x, y, n_begin, n_end);
  }
}

// Rows [n_begin, n_end) of W as fp32, (n_end - n_begin, K) row-major into out.
inline void dequantize_rows(int64_t type, const uint8_t* w, int64_t K, int64_t n_begin, int64_t n_end, float* out) {
  const int64_t stride = row_bytes(type, K);
  for (int64_t n = n_begin; n < n_end; ++n, out += K)
    for (int64_t s = 0; s < K / SUB; ++s) {
      const Sub sb = sub_block(type, w + n * stride, s);
      const __m256 a = _mm256_set1_ps(sb.a), b = _mm256_set1_ps(sb.b);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + s * SUB + 8 * j, _mm256_fmadd_ps(a, sb.q[j], b));
    }
}

}  // namespace servelab::quant
