// Pieces of the lane-wise online softmax shared by the AMX / AVX512-BF16 prefill kernels
// (prefill_softmax.h) and the AMX chunk kernel (chunk_paged_amx.h): 16 query columns in the
// lanes of an AVX-512 vector, keys along rows, logits in base 2. Needs <immintrin.h> with
// AVX-512F / BW and AVX512-DQ (vreduceps). Included once per unit, inside its namespace.

// The running max before a column has seen a key: finite, so that a column whose first
// processed blocks lie outside its window keeps alpha = 1 and l = 0 (with -inf, alpha would be
// exp2(-inf + inf) = NaN), and exp2(kNoMax - m_new) is exactly 0 (vexp2 flushes below -126)
// once it sees one, as -inf gave.
constexpr float kNoMax = -1e30f;

// A block's probabilities against a column's current max m may reach this much (sum over the
// block) before the max is moved: a lazy max (see block_softmax). 2^8: the rounded
// probabilities stay far from bf16's and fp32's limits, and a row's max rarely grows that much
// after its first keys.
constexpr float kLazySum = 256.0f;

// Keys k0 of the columns' lanes that are visible: thr - reach <= k0 <= thr, as one unsigned
// compare of thr - k0 against reach (negative differences wrap past it).
static inline __mmask16 visible_keys(__m512i thr, __m512i reach, int64_t k0) {
  return _mm512_cmple_epu32_mask(_mm512_sub_epi32(thr, _mm512_set1_epi32((int)k0)), reach);
}

// (p0[c], p1[c]) of each lane c as one 32-bit word of two bf16, p0 in the low half: the pair
// order of an AMX tile's rows. The high halves of the fp32 words of p0 and p1 (indices from 32
// select from the second source), rounded to nearest (ties away) by adding half a bf16 unit
// first: three instructions per two vectors, ~5% faster than vcvtne2ps2bf16 + vpermw.
static inline __m512i bf16_pair_words(__m512 p0, __m512 p1) {
  const __m512i interleave = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51,
                                              19, 49, 17, 47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37,
                                              5, 35, 3, 33, 1);
  const __m512i half_unit = _mm512_set1_epi32(0x8000);
  return _mm512_permutex2var_epi16(_mm512_add_epi32(_mm512_castps_si512(p0), half_unit),
                                   interleave,
                                   _mm512_add_epi32(_mm512_castps_si512(p1), half_unit));
}

// 2^t for finite t to 7.5e-5 (2^-13.7) relative error: 2^(t - floor t) by a degree-3
// polynomial on [0, 1) (minimax fit of the relative error; 2^0 comes out as 1 - 7.5e-5), times
// 2^floor(t) by scalef, which floors its exponent operand itself (and gives 0 or inf past the
// ends of the range). vreduceps gives t - floor(t) in one instruction: 5 vector instructions in
// all. The probabilities are rounded to bf16 (2^-9 relative) for the value product, where the
// error is invisible; the row sum l adds them unrounded, so the lse moves by at most 7.5e-5
// (degree 4, 2.7e-6, cost one more instruction per vector: ~4% of the kernel).
static inline __m512 fast_exp2(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.07802419364452362f), f,
                             _mm512_set1_ps(0.2260672152042389f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6958337426185608f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999251961708069f));
  return _mm512_scalef_ps(p, t);
}
