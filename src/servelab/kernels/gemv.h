// Single-row y = W x with bf16 W and fp32 x (a decode step of one sequence): memory-bound, so it
// is all about streaming W. Callers split the rows of W into one contiguous slab per thread. rows()
// reads W as stored; packed_rows() reads a copy packed for streaming (DecodeRunner's).
//
// A 32-byte load holds 16 bf16; in each 32-bit lane the even element is the low half, so
// (v << 16) is the even elements as fp32 and (v & 0xFFFF0000) the odd ones: two ALU ops widen 16
// weights, against x split once into its even and odd elements (split_even_odd).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace servelab::gemv {

// Rows are read one after another, so a thread's slab of W is a single sequential stream: on this
// Zen 1 machine that pulls ~19 GB/s from two cores where interleaving the rows of a 4-row tile
// (fewer loads of x, but four streams) gets ~15. The prefetch runs this far ahead of the loads.
constexpr int64_t PREFETCH_BYTES = 1024;

// x (K fp32, K % 16 == 0) -> its even and odd elements of each 16-block, K / 2 each.
inline void split_even_odd(const float* x, int64_t K, float* x_even, float* x_odd) {
  for (int64_t k = 0; k < K; k += 16)
    for (int i = 0; i < 8; ++i) {
      x_even[k / 2 + i] = x[k + 2 * i];
      x_odd[k / 2 + i] = x[k + 2 * i + 1];
    }
}

// y[n] = W[n] . x for n in [n_begin, n_end); W is (N, K) row-major bf16 bits, K % 16 == 0.
inline void rows(const float* x_even, const float* x_odd, const uint16_t* w, int64_t K, float* y,
                 int64_t n_begin, int64_t n_end) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto fma16 = [&](const uint16_t* r, int64_t k, __m256& even, __m256& odd) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + k));
    even = _mm256_fmadd_ps(_mm256_loadu_ps(x_even + k / 2), _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(x_odd + k / 2), _mm256_castsi256_ps(_mm256_and_si256(v, high)), odd);
  };
  for (int64_t n = n_begin; n < n_end; ++n) {
    const uint16_t* r = w + n * K;
    __m256 even0 = _mm256_setzero_ps(), odd0 = even0, even1 = even0, odd1 = even0;  // two chains per half
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {  // one 64-byte line per iteration
      _mm_prefetch(reinterpret_cast<const char*>(r + k) + PREFETCH_BYTES, _MM_HINT_T0);
      fma16(r, k, even0, odd0);
      fma16(r, k + 16, even1, odd1);
    }
    if (k < K) fma16(r, k, even0, odd0);
    y[n] = simd::hsum(_mm256_add_ps(_mm256_add_ps(even0, odd0), _mm256_add_ps(even1, odd1)));
  }
}

// ---- Packed weights: rows in groups of 4 with their 16-column blocks interleaved, so one pass
// over a group reads it front to back while each load of x serves four rows:
// [r0 k0:16][r1 k0:16][r2 k0:16][r3 k0:16][r0 k16:32]... That streams ~21 GB/s (vs ~19 unpacked).
constexpr int64_t PACK = 4;
constexpr int64_t PACKED_PREFETCH_BYTES = 1024;

// W (N, K) row-major, N % PACK == 0, K % 16 == 0 -> packed (same size).
inline void pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  for (int64_t g = 0; g < N / PACK; ++g)
    for (int64_t k = 0; k < K; k += 16)
      for (int64_t j = 0; j < PACK; ++j)
        std::memcpy(out + g * PACK * K + k * PACK + j * 16, w + (g * PACK + j) * K + k, 16 * sizeof(uint16_t));
}

// rows() over packed W; n_begin, n_end multiples of PACK.
inline void packed_rows(const float* x_even, const float* x_odd, const uint16_t* w, int64_t K, float* y,
                        int64_t n_begin, int64_t n_end) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t n = n_begin; n < n_end; n += PACK) {
    const uint16_t* p = w + n * K;
    __m256 even[PACK], odd[PACK];
    for (int j = 0; j < PACK; ++j) even[j] = odd[j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16, p += 16 * PACK) {  // two 64-byte lines per iteration
      _mm_prefetch(reinterpret_cast<const char*>(p) + PACKED_PREFETCH_BYTES, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p) + PACKED_PREFETCH_BYTES + 64, _MM_HINT_T0);
      const __m256 xe = _mm256_loadu_ps(x_even + k / 2), xo = _mm256_loadu_ps(x_odd + k / 2);
      for (int j = 0; j < PACK; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * j));
        even[j] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), even[j]);
        odd[j] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(v, high)), odd[j]);
      }
    }
    for (int j = 0; j < PACK; ++j) y[n + j] = simd::hsum(_mm256_add_ps(even[j], odd[j]));
  }
}

// Thread t's share [begin, end) of n rows among nt threads, in whole packed groups (n % PACK == 0).
inline void packed_slab(int64_t n, int t, int nt, int64_t& begin, int64_t& end) {
  begin = n / PACK * t / nt * PACK;
  end = n / PACK * (t + 1) / nt * PACK;
}

}  // namespace servelab::gemv
