// The two element-wise passes around the int8 x int8 -> int32 matmul of prefill-sized inputs
// on per-channel int8 weights (W8A8 with one dynamic scale per row of x, as vLLM's CPU int8
// path and SmoothQuant's per-token variant do): quantize the rows of x before it, scale the
// int32 products back after it. Included inside an ISA namespace compiled for AVX-512 (F, BW,
// VL).

// Sixteen elements of row data starting at element j: bf16 bit patterns or fp32; `n` < 16 loads
// the first n and zeros the rest.
static inline __m512 load_row16(const void* x, bool bf16, int64_t j, int n = 16) {
  const __mmask16 mask = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
  if (bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(x) + j);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(x) + j);
}

// Rows [r_begin, r_end) of x [m, k] (row stride `stride` elements, bf16 or fp32) as int8 codes
// q [m, k] (row stride k) and scales [m]: s = max|x_r| / 127 and q = x * (127 / max|x_r|)
// rounded to nearest even, so x_r ~= s * q. A row of zeros, or so small that 127 / max|x_r|
// overflows (max below ~3.7e-37), gets s = 0 and zero codes; a row holding NaN or infinity a
// NaN scale (its outputs come out NaN).
static void quantize_rows(const void* x, bool bf16, int64_t stride, int64_t k, int64_t r_begin,
                          int64_t r_end, int8_t* q, float* scales) {
  const size_t elem = bf16 ? 2 : 4;
  for (int64_t r = r_begin; r < r_end; ++r) {
    const void* row = static_cast<const char*>(x) + r * stride * elem;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;  // max_ps drops NaN operands: track them apart
    for (int64_t j = 0; j < k; j += 16) {
      const __m512 v = load_row16(row, bf16, j, (int)(k - j));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float top = _mm512_reduce_max_ps(amax);
    int8_t* out = q + r * k;
    const bool finite = nan == 0 && top <= 3.4028235e38f;
    const float inv_top = 127.0f / top;
    if (!(finite && inv_top <= 3.4028235e38f)) {
      for (int64_t j = 0; j < k; ++j) out[j] = 0;
      scales[r] = finite ? 0.0f : __builtin_nanf("");
      continue;
    }
    scales[r] = top / 127.0f;
    const __m512 inv = _mm512_set1_ps(inv_top);
    for (int64_t j = 0; j < k; j += 16) {
      const int n = (int)(k - j < 16 ? k - j : 16);
      const __m512i codes = _mm512_cvt_roundps_epi32(
          _mm512_mul_ps(load_row16(row, bf16, j, n), inv),
          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm512_mask_cvtsepi32_storeu_epi8(out + j, (__mmask16)((1u << n) - 1u), codes);
    }
  }
}

// Sixteen fp32 lanes stored at element c of y's row (bf16: rounded to nearest even, NaN as the
// quiet NaN, as round_bf16 in kernel_common_impl.h); `mask` selects the lanes written.
static inline void store_row16(void* y, bool bf16, int64_t at, __mmask16 mask, __m512 v) {
  if (!bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(y) + at, mask, v);
    return;
  }
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7fc0));
  _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(y) + at, mask, rounded);
}

// Lanes c .. c + 15 of one row of products, scaled: acc * row scale * col_scale[c] + bias[c].
static inline __m512 scaled16(const int32_t* acc, __m512 rs, const float* col_scale,
                              const float* bias, int64_t c, __mmask16 mask) {
  const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, acc + c)), rs);
  const __m512 cs = _mm512_maskz_loadu_ps(mask, col_scale + c);
  return bias ? _mm512_fmadd_ps(v, cs, _mm512_maskz_loadu_ps(mask, bias + c))
              : _mm512_mul_ps(v, cs);
}

// Rows [r_begin, r_end) of y [m, n] (row stride y_stride, bf16 or fp32) = acc [m, n] int32
// (row stride n) * row_scale[r] * col_scale[c] (+ bias[c]), rounded once to y's dtype.
static void scale_rows(const int32_t* acc, int64_t n, int64_t r_begin, int64_t r_end,
                       const float* row_scale, const float* col_scale, const float* bias,
                       void* y, bool bf16, int64_t y_stride) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    const __m512 rs = _mm512_set1_ps(row_scale[r]);
    for (int64_t c = 0; c < n; c += 16) {
      const int left = (int)(n - c < 16 ? n - c : 16);
      const __mmask16 mask = (__mmask16)((1u << left) - 1u);
      store_row16(y, bf16, r * y_stride + c, mask,
                  scaled16(acc + r * n, rs, col_scale, bias, c, mask));
    }
  }
}

// e^x in fp32 lanes, x clamped to [-87.3, 89] (inf past ~88.72 as in fp32, never 0; NaN lanes
// come out as inf, callers carry NaN through their other operand): 2^k * p(t), k = round(x / ln 2),
// t = x - k ln 2 (ln 2 split in two for exactness), |t| <= ln 2 / 2, and p the degree-6 Taylor
// polynomial (relative error below 2e-7).
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-87.3f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 t = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  t = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.4286068203e-06f), t);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// act(g) = g / (1 + e^-u): SiLU with u = g (act 0); tanh GELU with u = 2z,
// z = sqrt(2 / pi) (g + 0.044715 g^3) (act 1), since 0.5 g (1 + tanh z) = g / (1 + e^-2z),
// which avoids the cancellation of 1 + tanh z for negative z.
static inline __m512 gate16(__m512 g, int act) {
  __m512 u = g;
  if (act == 1) {
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    u = _mm512_mul_ps(_mm512_set1_ps(2.0f * 0.7978845608f),
                      _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
  }
  const __m512 denominator =
      _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), u)));
  return _mm512_div_ps(g, denominator);
}

// The gated variant of scale_rows for a fused gate / up projection: acc [m, 2n] holds the gate
// products in columns [0, n) and the up products in [n, 2n); y [m, n] = act(gate) * up, each
// scaled as scale_rows does, in fp32, rounded once (act: 0 SiLU, 1 tanh GELU).
static void scale_rows_gated(const int32_t* acc, int64_t n, int64_t r_begin, int64_t r_end,
                             const float* row_scale, const float* col_scale, const float* bias,
                             void* y, bool bf16, int64_t y_stride, int act) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    const __m512 rs = _mm512_set1_ps(row_scale[r]);
    const int32_t* a = acc + r * 2 * n;
    for (int64_t c = 0; c < n; c += 16) {
      const int left = (int)(n - c < 16 ? n - c : 16);
      const __mmask16 mask = (__mmask16)((1u << left) - 1u);
      const __m512 gate = scaled16(a, rs, col_scale, bias, c, mask);
      const __m512 up = scaled16(a + n, rs, col_scale + n, bias ? bias + n : nullptr, c, mask);
      store_row16(y, bf16, r * y_stride + c, mask, _mm512_mul_ps(gate16(gate, act), up));
    }
  }
}
