// The AVX512-BF16 prefill kernel with Q·K^T in int8 (AVX512-VNNI vpdpbusd), in the manner of
// SageAttention (Zhang et al., 2024, "SageAttention: Accurate 8-bit attention for plug-and-play
// inference acceleration"): the keys are smoothed (each channel's mean over the keys
// subtracted, which shifts every logit of a query row by the same q·mean and so leaves its
// softmax as it was) and quantized per key, the queries per row, both symmetric int8; the
// value product and the online softmax are those of prefill_bf16.h. Included by
// isa_avx512_bf16.cpp after prefill_bf16.h; interface in prefill.h (PrefillQk8Kernel).
//
// vpdpbusd multiplies unsigned bytes by signed ones, so the key codes are stored offset by 128
// (u8 = code + 128): a product row sums q·(k + 128) = q·k + 128 Σq, and 128 Σq, one integer
// per query column (qcorr), is subtracted before scaling. Logit = (acc - qcorr) * sq * sk.
// Four key elements per 32-bit word: a block's logits take d / 4 vpdpbusd per 16 columns of a
// key where the bf16 kernel takes d / 2 vdpbf16ps, each the same one-per-cycle instruction.

// Channel means of head h's keys into mean[d] (keys: rows of d bf16, row stride s1, nk of
// them); a channel whose mean is not finite (a NaN or inf key, an overflowing sum) gets 0, so
// one non-finite key cannot spread to the rows that do not see it. (A huge finite one still
// sets the mean that every key loses: see docs/models.md on the limits.)
static void key_means_qk8(const uint16_t* key, int64_t s1, int64_t nk, int64_t d, float* mean) {
  for (int64_t e0 = 0; e0 < d; e0 += 16) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; ++j) sum = _mm512_add_ps(sum, load_bf16x16(key + j * s1 + e0));
    const __m512 m = _mm512_mul_ps(sum, _mm512_set1_ps(nk > 0 ? 1.0f / (float)nk : 0.0f));
    const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_sub_ps(m, m), _mm512_setzero_ps(),
                                                _CMP_EQ_OQ);
    _mm512_storeu_ps(mean + e0, _mm512_maskz_mov_ps(finite, m));
  }
}

// Symmetric int8 codes of x[d] (fp32 in 16-lane chunks v[0 .. d / 16)) into dst as bytes of
// code + offset, rounded to nearest even, and their sum into code_sum (if given); returns the
// scale max|x| / 127. A zero row (or one so small that 127 / max overflows) gets codes 0 and
// scale 0; a row with a NaN or inf gets codes 0 and a NaN scale, so its products come out NaN
// as the bf16 kernel's would.
static inline float quantize_row_qk8(const __m512* v, int64_t chunks, int offset, uint8_t* dst,
                                     int32_t* code_sum) {
  __m512 mx = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    mx = _mm512_max_ps(mx, _mm512_abs_ps(v[c]));
    bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v[c], v[c]), _mm512_setzero_ps(), _CMP_NEQ_UQ);
  }
  const float amax = _mm512_reduce_max_ps(mx);
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  const bool usable = bad == 0 && inv <= 3.0e38f;  // inv inf: a subnormal max
  const __m512 mul = _mm512_set1_ps(inv);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t c = 0; c < chunks; ++c) {
    // nearest even; zero for an unusable row (NaN x 0 would convert to INT_MIN)
    const __m512i code =
        usable ? _mm512_cvtps_epi32(_mm512_mul_ps(v[c], mul)) : _mm512_setzero_si512();
    sum = _mm512_add_epi32(sum, code);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c * 16),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(code, _mm512_set1_epi32(offset))));
  }
  if (code_sum != nullptr) *code_sum = _mm512_reduce_add_epi32(sum);
  if (bad != 0) return __builtin_nanf("");
  return usable ? amax / 127.0f : 0.0f;
}

// Keys [j0, j1) of one head, smoothed by mean, as offset codes (rows of d bytes) and scales;
// keys from nk on get code 0 (byte 128) and scale 0.
static void quantize_keys_qk8(const uint16_t* key, int64_t s1, int64_t j0, int64_t j1, int64_t nk,
                              int64_t d, const float* mean, uint8_t* codes, float* scales) {
  __m512 v[16];  // d <= 256 (the binding checks)
  const int64_t chunks = d / 16;
  for (int64_t j = j0; j < j1; ++j) {
    if (j >= nk) {
      __builtin_memset(codes + j * d, 128, d);
      scales[j] = 0.0f;
      continue;
    }
    for (int64_t c = 0; c < chunks; ++c)
      v[c] = _mm512_sub_ps(load_bf16x16(key + j * s1 + c * 16), _mm512_loadu_ps(mean + c * 16));
    scales[j] = quantize_row_qk8(v, chunks, 128, codes + j * d, nullptr);
  }
}

// Int8 query codes of the item's columns as words of four, [tiles][d / 4][16 columns] in
// w.qpairs, with each column's scale (w.qscale) and 128 x its code sum (w.qcorr); columns past
// nq get zero codes and scale 0 (finite logits of 0, never written), and w.qshift = q · the
// key means (fp32). Sets w.thr as pack_queries does.
static void pack_queries_qk8(const PrefillArgs& a, int64_t kvh, int64_t q0,
                             const PrefillScratch& w) {
  const int64_t G = a.num_heads / a.num_kv_heads, BQ = a.query_block, d = a.head_dim;
  const int64_t quarter = d / 4, chunks = d / 16;
  __m512 v[16];
  alignas(64) uint8_t row_codes[256];
  for (int64_t h = 0; h < G; ++h)
    for (int64_t r = 0; r < BQ; ++r) {
      const int64_t col = h * BQ + r, row = q0 + r;
      w.thr[col] = (int32_t)(row < a.nq ? a.nk - a.nq + row : a.nk - 1);
      uint32_t* dst = w.qpairs + col / 16 * quarter * 16 + col % 16;
      if (row >= a.nq) {
        for (int64_t e = 0; e < quarter; ++e) dst[e * 16] = 0;
        w.qscale[col] = 0.0f;
        w.qcorr[col] = 0;
        w.qshift[col] = 0.0f;
        continue;
      }
      const uint16_t* src =
          a.query + (kvh * G + h) * a.query_head_stride + row * a.query_row_stride;
      const float* mean = a.key_means + kvh * d;
      __m512 shift = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        v[c] = load_bf16x16(src + c * 16);
        shift = _mm512_fmadd_ps(v[c], _mm512_loadu_ps(mean + c * 16), shift);
      }
      w.qshift[col] = _mm512_reduce_add_ps(shift);
      int32_t code_sum = 0;
      w.qscale[col] = quantize_row_qk8(v, chunks, 0, row_codes, &code_sum);
      w.qcorr[col] = 128 * code_sum;
      for (int64_t e = 0; e < quarter; ++e) __builtin_memcpy(dst + e * 16, row_codes + 4 * e, 4);
    }
}

// acc += the four-byte dot products of u (unsigned) and s (signed) per 32-bit lane. Inline asm:
// GCC 12's _mm512_dpbusd_epi32 copied every accumulator around each instruction (a register
// move per product, spills past 16 accumulators), which left the int8 loop no faster than
// the bf16 one.
static inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// Logits of keys key + [0, NR) for the NC column tiles `t` into w.s, in int8 (see the top).
template <int NC>
static inline void logits_block_qk8(const PrefillArgs& a, const uint32_t* K, const float* ks,
                                    int64_t key, const int* t, const PrefillScratch& w) {
  constexpr int NR = DpBlock<NC>::kRows;
  const int64_t quarter = a.head_dim / 4;
  __m512i acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_si512();
  const uint32_t* qp[NC];
  for (int c = 0; c < NC; ++c) qp[c] = w.qpairs + t[c] * quarter * 16;
  const uint32_t* krow = K + key * quarter;
  for (int64_t e = 0; e < quarter; ++e) {
    __m512i q[NC];
    for (int c = 0; c < NC; ++c) q[c] = _mm512_loadu_si512(qp[c] + e * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512i k = _mm512_set1_epi32((int)krow[r * quarter + e]);
      for (int c = 0; c < NC; ++c) acc[r][c] = dpbusd(acc[r][c], k, q[c]);
    }
  }
  const int64_t k = key % kPKeys;
  for (int c = 0; c < NC; ++c) {
    const __m512i corr = _mm512_loadu_si512(w.qcorr + t[c] * 16);
    const __m512 sq = _mm512_loadu_ps(w.qscale + t[c] * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512 s = _mm512_mul_ps(sq, _mm512_set1_ps(ks[key + r]));
      const __m512 logit = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], corr));
      _mm512_storeu_ps(w.s + (t[c] * kPKeys + k + r) * 16, _mm512_mul_ps(logit, s));
    }
  }
}

template <int NC>
static void logits_qk8(const PrefillArgs& a, const uint32_t* K, const float* ks, int64_t k0,
                       const int* t, const PrefillScratch& w) {
  for (int64_t k = 0; k < kPKeys; k += DpBlock<NC>::kRows)
    logits_block_qk8<NC>(a, K, ks, k0 + k, t, w);
}

// The logits of key block k0 for the listed column tiles (for_tile_groups' register blocks).
static void logits_all_qk8(const PrefillArgs& a, const uint32_t* K, const float* ks, int64_t k0,
                           const int* tiles, int nt, const PrefillScratch& w) {
  for_tile_groups(tiles, nt, [&](auto cols, const int* t) {
    logits_qk8<decltype(cols)::value>(a, K, ks, k0, t, w);
  });
}

// prefill_item_bf16 with the int8 logits: keys from a.key_codes / a.key_scales.
static void prefill_item_qk8(const PrefillArgs& a, int64_t kvh, int64_t qb, float* scratch) {
  const uint32_t* K = reinterpret_cast<const uint32_t*>(a.key_codes + kvh * a.nkp * a.head_dim);
  const float* ks = a.key_scales + kvh * a.nkp;
  prefill_item_bf16_with(a, kvh, qb, scratch, [&](int64_t k0, const int* tiles, int nt,
                                                  const PrefillScratch& w) {
    logits_all_qk8(a, K, ks, k0, tiles, nt, w);
  }, pack_queries_qk8, true);
}
