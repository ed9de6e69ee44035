// bf16 matrix-vector product y = W x for one row of activations (decode at batch 1), with
// AVX512-BF16 dot products: fp32 accumulation of exact bf16 products, one rounding to bf16 at
// the end, as oneDNN's bf16 linear does. Plain-C++ interface (fused.h): no torch or standard
// headers under this target pragma.
#include <stdint.h>

#include "fused.h"

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <immintrin.h>

namespace sparsekv_fused {
namespace {

inline uint16_t round_bf16(float value) {
  union {
    float f;
    uint32_t u;
  } bits{value};
  if ((bits.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  const uint32_t bias = 0x7fffu + ((bits.u >> 16) & 1u);    // round to nearest even
  return static_cast<uint16_t>((bits.u + bias) >> 16);
}

inline __m512bh load_bh(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// How far ahead the weight stream is prefetched. Decode reads every weight from memory once,
// in short calls, and the hardware prefetchers alone fall behind on a VM whose memory latency
// is ~250 ns: SmolLM2 bf16 batch-1 decode after 512 tokens went from 55.7 to 63.6 tok/s with
// it (2 cores, Emerald Rapids, 6 alternating rounds in one process).
constexpr int64_t kPrefetchBytes = 16384;

}  // namespace

// Rows [begin, end) of y [n] = W [n, k] (row stride k) x [k]; bf16 in and out.
void gemv_bf16_avx512(const GemvArgs& a, int64_t begin, int64_t end) {
  const int64_t k = a.k, full = k / 32 * 32;
  const __mmask32 tail = k == full ? 0 : (__mmask32)((1ull << (k - full)) - 1);
  const uint16_t* x = a.x;
  int64_t r = begin;
  for (; r + 4 <= end; r += 4) {
    const uint16_t* w0 = a.w + r * k;
    const uint16_t* w1 = w0 + k;
    const uint16_t* w2 = w1 + k;
    const uint16_t* w3 = w2 + k;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    __m512 s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    // The four rows are adjacent: each step reads 256 bytes of them, so step i prefetches the
    // 256 bytes at the same place kPrefetchBytes further on (not past this call's rows).
    const char* rows = reinterpret_cast<const char*>(w0);
    const int64_t left = (end - r) * k * 2;  // bytes from w0 to the end of this call's rows
    for (int64_t i = 0; i < full; i += 32) {
      for (int64_t at = kPrefetchBytes + 8 * i; at < kPrefetchBytes + 8 * i + 256 && at < left;
           at += 64)
        __builtin_prefetch(rows + at, 0, 3);
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
      s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_loadu_si512(w0 + i), xv);
      s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_loadu_si512(w1 + i), xv);
      s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_loadu_si512(w2 + i), xv);
      s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_loadu_si512(w3 + i), xv);
    }
    if (tail) {
      const __m512bh xv = load_bh(x + full, tail);
      s0 = _mm512_dpbf16_ps(s0, load_bh(w0 + full, tail), xv);
      s1 = _mm512_dpbf16_ps(s1, load_bh(w1 + full, tail), xv);
      s2 = _mm512_dpbf16_ps(s2, load_bh(w2 + full, tail), xv);
      s3 = _mm512_dpbf16_ps(s3, load_bh(w3 + full, tail), xv);
    }
    a.y[r] = round_bf16(_mm512_reduce_add_ps(s0));
    a.y[r + 1] = round_bf16(_mm512_reduce_add_ps(s1));
    a.y[r + 2] = round_bf16(_mm512_reduce_add_ps(s2));
    a.y[r + 3] = round_bf16(_mm512_reduce_add_ps(s3));
  }
  for (; r < end; ++r) {
    const uint16_t* w0 = a.w + r * k;
    __m512 s0 = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 32)
      s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_loadu_si512(w0 + i),
                            (__m512bh)_mm512_loadu_si512(x + i));
    if (tail) s0 = _mm512_dpbf16_ps(s0, load_bh(w0 + full, tail), load_bh(x + full, tail));
    a.y[r] = round_bf16(_mm512_reduce_add_ps(s0));
  }
}

const bool kGemvAvx512Bf16Compiled = true;
}  // namespace sparsekv_fused
#else
namespace sparsekv_fused {
void gemv_bf16_avx512(const GemvArgs&, int64_t, int64_t) {}
const bool kGemvAvx512Bf16Compiled = false;
}  // namespace sparsekv_fused
#endif
