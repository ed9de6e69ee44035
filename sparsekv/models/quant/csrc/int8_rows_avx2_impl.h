// int8_rows_impl.h's passes on 8-lane AVX2 vectors, for CPUs without int8 dot products: the
// int8 x int8 -> int32 matmul between them is oneDNN's int8 GEMM without VNNI (vpmaddubsw /
// vpmaddwd), whose int16 pair sums saturate unless the weight codes stay within +-64 (the
// caller quantizes them so: int8_rows.int8_gemm_saturates). Same results as the AVX-512
// passes: the same scales, codes (nearest even), products and one rounding to y's dtype.
// Included inside an ISA namespace compiled for AVX2 + FMA.

// Eight elements of row data from element j (bf16 bit patterns or fp32); `n` < 8 reads the
// first n and zeros the rest.
static inline __m256 load_row8(const void* x, bool bf16, int64_t j, int n = 8) {
  const size_t elem = bf16 ? 2 : 4;
  const char* at = static_cast<const char*>(x) + j * elem;
  alignas(32) uint8_t tail[32] = {};
  if (n < 8) {
    __builtin_memcpy(tail, at, n * elem);
    at = reinterpret_cast<const char*>(tail);
  }
  if (bf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(reinterpret_cast<const float*>(at));
}

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// quantize_rows of int8_rows_impl.h: s = max|x_r| / 127, codes round(x * 127 / max|x_r|).
static void quantize_rows(const void* x, bool bf16, int64_t stride, int64_t k, int64_t r_begin,
                          int64_t r_end, int8_t* q, float* scales) {
  const size_t elem = bf16 ? 2 : 4;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = r_begin; r < r_end; ++r) {
    const void* row = static_cast<const char*>(x) + r * stride * elem;
    __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j += 8) {
      const __m256 v = load_row8(row, bf16, j, (int)(k - j < 8 ? k - j : 8));
      amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    const float top = hmax8(amax);
    int8_t* out = q + r * k;
    const bool finite = _mm256_movemask_ps(nan) == 0 && top <= 3.4028235e38f;
    const float inv_top = 127.0f / top;
    if (!(finite && inv_top <= 3.4028235e38f)) {
      for (int64_t j = 0; j < k; ++j) out[j] = 0;
      scales[r] = finite ? 0.0f : __builtin_nanf("");
      continue;
    }
    scales[r] = top / 127.0f;
    const __m256 inv = _mm256_set1_ps(inv_top);
    for (int64_t j = 0; j < k; j += 8) {
      const int n = (int)(k - j < 8 ? k - j : 8);
      // rounded to nearest even whatever MXCSR says (as the AVX-512 pass's embedded rounding);
      // the packs saturate
      const __m256 scaled = _mm256_round_ps(_mm256_mul_ps(load_row8(row, bf16, j, n), inv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i codes = _mm256_cvtps_epi32(scaled);
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes),
                                            _mm256_extracti128_si256(codes, 1));
      const __m128i bytes = _mm_packs_epi16(words, words);
      if (n == 8) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), bytes);
      } else {
        alignas(16) int8_t part[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(part), bytes);
        __builtin_memcpy(out + j, part, n);
      }
    }
  }
}

// Eight fp32 lanes stored at element `at` of y (bf16: rounded to nearest even, NaN as the quiet
// NaN, as round_bf16 in kernel_common_impl.h); the first n lanes only.
static inline void store_row8(void* y, bool bf16, int64_t at, int n, __m256 v) {
  alignas(32) uint8_t part[32];
  if (!bf16) {
    float* out = static_cast<float*>(y) + at;
    if (n == 8) return _mm256_storeu_ps(out, v);
    _mm256_store_ps(reinterpret_cast<float*>(part), v);
    __builtin_memcpy(out, part, n * 4);
    return;
  }
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                          _mm256_extracti128_si256(rounded, 1));
  uint16_t* out = static_cast<uint16_t*>(y) + at;
  if (n == 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(out), halves);
  _mm_store_si128(reinterpret_cast<__m128i*>(part), halves);
  __builtin_memcpy(out, part, n * 2);
}

// Lanes c .. c + 7 of one row of products, scaled: acc * row scale * col_scale[c] + bias[c]
// (the first n lanes; the rest read as zero).
static inline __m256 scaled8(const int32_t* acc, __m256 rs, const float* col_scale,
                             const float* bias, int64_t c, int n) {
  __m256 v, cs, b = _mm256_setzero_ps();
  if (n == 8) {
    v = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + c)));
    cs = _mm256_loadu_ps(col_scale + c);
    if (bias) b = _mm256_loadu_ps(bias + c);
  } else {
    alignas(32) int32_t a8[8] = {};
    alignas(32) float c8[8] = {}, b8[8] = {};
    __builtin_memcpy(a8, acc + c, n * 4);
    __builtin_memcpy(c8, col_scale + c, n * 4);
    if (bias) __builtin_memcpy(b8, bias + c, n * 4);
    v = _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(a8)));
    cs = _mm256_load_ps(c8);
    b = _mm256_load_ps(b8);
  }
  v = _mm256_mul_ps(v, rs);
  return bias ? _mm256_fmadd_ps(v, cs, b) : _mm256_mul_ps(v, cs);
}

// scale_rows of int8_rows_impl.h.
static void scale_rows(const int32_t* acc, int64_t n, int64_t r_begin, int64_t r_end,
                       const float* row_scale, const float* col_scale, const float* bias,
                       void* y, bool bf16, int64_t y_stride) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    const __m256 rs = _mm256_set1_ps(row_scale[r]);
    for (int64_t c = 0; c < n; c += 8) {
      const int left = (int)(n - c < 8 ? n - c : 8);
      store_row8(y, bf16, r * y_stride + c, left,
                 scaled8(acc + r * n, rs, col_scale, bias, c, left));
    }
  }
}

// exp16 of int8_rows_impl.h on 8 lanes: x clamped to [-87.3, 89], 2^k * p(t); vscalefps's
// 2^k (k up to 128) as two exact power-of-two factors, which round once, as it does.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(89.0f)), _mm256_set1_ps(-87.3f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 t = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
  t = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.4286068203e-06f), t);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f));
  const __m256i ki = _mm256_cvtps_epi32(k);  // in [-126, 128]
  const __m256i half = _mm256_srai_epi32(ki, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ki, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

// gate16 of int8_rows_impl.h: act(g) = g / (1 + e^-u), u = g (SiLU, act 0) or 2z with
// z = sqrt(2 / pi) (g + 0.044715 g^3) (tanh GELU, act 1).
static inline __m256 gate8(__m256 g, int act) {
  __m256 u = g;
  if (act == 1) {
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    u = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608f),
                      _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  }
  const __m256 denominator =
      _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), u)));
  return _mm256_div_ps(g, denominator);
}

// scale_rows_gated of int8_rows_impl.h: y [m, n] = act(gate) * up from products [m, 2n].
static void scale_rows_gated(const int32_t* acc, int64_t n, int64_t r_begin, int64_t r_end,
                             const float* row_scale, const float* col_scale, const float* bias,
                             void* y, bool bf16, int64_t y_stride, int act) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    const __m256 rs = _mm256_set1_ps(row_scale[r]);
    const int32_t* a = acc + r * 2 * n;
    for (int64_t c = 0; c < n; c += 8) {
      const int left = (int)(n - c < 8 ? n - c : 8);
      const __m256 gate = scaled8(a, rs, col_scale, bias, c, left);
      const __m256 up = scaled8(a + n, rs, col_scale + n, bias ? bias + n : nullptr, c, left);
      store_row8(y, bf16, r * y_stride + c, left, _mm256_mul_ps(gate8(gate, act), up));
    }
  }
}
