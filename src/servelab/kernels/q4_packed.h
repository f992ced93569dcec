// Q4_0 / Q4_1 matrices repacked for one-row products against inputs rounded to 8 bits (the one-call
// decode step's GEMVs). Read as stored, a 20-byte Q4_1 block costs two fp16 conversions, a scalar
// product and a nibble split per 32 weights, which kept quant_blocks.h's int8_rows at ~19 GB/s on
// two Zen 4 cores (Q8_0, with no nibbles, reaches ~36). Repacked, each row is
//   [a: S fp16][b: S fp16][S / 2 pairs of 32 bytes]     (S = K / 32 sub-blocks, K % 64 == 0)
// where byte i of pair p holds value i of sub-block 2p in its low nibble and value i of sub-block
// 2p + 1 in its high nibble: one 32-byte load, a shift and two ANDs give two sub-blocks, the
// scales of a row convert eight at a time, and its offset sum_s b_s s_s is a vector dot product.
// Q4_1's size (Q4_0 gains 2 bytes per 32 values for b); w = a q + b as stored (Q4_0: b = -8 a, exact in fp16).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_blocks.h"

namespace servelab::q4_packed {

constexpr int64_t MAX_SUB = 512;  // K up to 16,384
constexpr int64_t TYPE = 1000;  // the runner's type id of a packed matrix (not a ggml id)

inline bool suits(int64_t type, int64_t K) {
  return (type == quant::Q4_0 || type == quant::Q4_1) && K % 64 == 0 && K / quant::SUB <= MAX_SUB;
}

inline int64_t row_bytes(int64_t K) { return 20 * (K / quant::SUB); }

// Rows [0, N) of W stored as `type` blocks (suits(type, K)) -> out, (N, row_bytes(K)).
inline void pack(int64_t type, const uint8_t* w, int64_t N, int64_t K, uint8_t* out) {
  const int64_t S = K / quant::SUB, stride = quant::row_bytes(type, K), packed_stride = row_bytes(K);
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = w + n * stride;
    uint8_t* dst = out + n * packed_stride;
    uint16_t* a = reinterpret_cast<uint16_t*>(dst);
    uint16_t* b = a + S;
    uint8_t* pairs = dst + 4 * S;
    uint8_t values[2][32];
    for (int64_t s = 0; s < S; ++s) {
      const uint8_t* blk = row + s * quant::block_bytes(type);
      std::memcpy(&a[s], blk, 2);
      if (type == quant::Q4_1) {
        std::memcpy(&b[s], blk + 2, 2);
      } else {
        b[s] = _cvtss_sh(-8.f * quant::fp16(blk), 0);  // exact: a power-of-two multiple of an fp16
      }
      const uint8_t* qs = blk + (type == quant::Q4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) values[s % 2][i] = qs[i] & 0x0F, values[s % 2][i + 16] = qs[i] >> 4;
      if (s % 2 == 1)
        for (int i = 0; i < 32; ++i) pairs[(s / 2) * 32 + i] = static_cast<uint8_t>(values[0][i] | (values[1][i] << 4));
    }
  }
}

// y[n] = row n . x^ for rows [n_begin, n_end) of a packed W of K columns.
inline void rows(const uint8_t* w, int64_t K, const quant::Q8Input& x, float* y, int64_t n_begin, int64_t n_end) {
  const int64_t S = K / quant::SUB, packed_stride = row_bytes(K);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float ad[MAX_SUB];  // a_s d_s: the sub-blocks' scales times the input's
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint8_t* row = w + n * packed_stride;
    const uint8_t* pairs = row + 4 * S;
    _mm_prefetch(reinterpret_cast<const char*>(row + packed_stride), _MM_HINT_T0);
    __m256 offset = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= S; s += 8) {
      const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * s)));
      const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * (S + s))));
      _mm256_store_ps(ad + s, _mm256_mul_ps(a, _mm256_loadu_ps(x.d + s)));
      offset = _mm256_fmadd_ps(b, _mm256_loadu_ps(x.s + s), offset);
    }
    float tail = 0.f;
    for (; s < S; ++s) {
      ad[s] = quant::fp16(row + 2 * s) * x.d[s];
      tail += quant::fp16(row + 2 * (S + s)) * x.s[s];
    }
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (int64_t p = 0; p < S / 2; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(pairs + p * 32) + 512, _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + p * 32));
      const __m256i w0 = _mm256_and_si256(v, low4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + p * 64));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + p * 64 + 32));
      const __m256 d0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w0, x0), ones));
      const __m256 d1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w1, x1), ones));
      acc0 = _mm256_fmadd_ps(_mm256_broadcast_ss(ad + 2 * p), d0, acc0);
      acc1 = _mm256_fmadd_ps(_mm256_broadcast_ss(ad + 2 * p + 1), d1, acc1);
    }
    y[n] = quant::hsum(_mm256_add_ps(acc0, acc1)) + quant::hsum(offset) + tail;
  }
}

}  // namespace servelab::q4_packed
