// The x16 int8-activation kernels (quant_x16_impl.h) and the two-level quantization of bf16 x
// (quant_q8_impl.h) on AVX2, for CPUs without AVX-512. Included by isa_avx2.cpp after
// kernel_common_impl.h, in its namespace.
//
// The integer sums and the fp32 operations per output are those of the avx512_vnni kernels, in
// the same order, so the results are equal bit for bit. AVX2 has no vpdpbusd: the four byte
// products of an int32 lane are summed by vpmaddubsw (unsigned x signed bytes, adjacent pairs
// to int16, saturating) and vpmaddwd against ones (pairs to int32). Nothing saturates: x's
// codes are in [-127, 127]; the 4-bit codes (0..15) give pairs below 2 * 15 * 127, and Q8_0's
// codes enter signed, |q| as the unsigned operand against x with q's sign (vpsignb), pairs
// below 2 * 128 * 127. Q8_0 then needs no zero point: sum q x directly.
//
// A group-block's 16 rows are two 8-lane halves (rows 0-7 from bytes 0-31 of each 64-byte code
// vector, rows 8-15 from bytes 32-63).

// The int32 lanes' sums of four byte products: u (unsigned) times s (signed).
static inline __m256i dot4_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// One group-block in registers: per code vector t and half h the unsigned codes (Q8_0: |q|)
// and, for Q8_0, the signed codes whose signs x takes; d and Q4_1's m per half.
template <int F>
struct X16Avx2Block {
  __m256i codes[8][2];
  __m256i signs[F == kQ8_0 ? 8 : 1][2];
  __m256 d[2], m[2];
};

template <int F>
static inline void x16_avx2_expand(const uint8_t* gb, X16Avx2Block<F>& blk) {
  const uint8_t* c = gb + x16_header_bytes<F>();
  for (int h = 0; h < 2; ++h) {
    if constexpr (F == kQ8_0) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // q + 128 -> q
      for (int t = 0; t < 8; ++t) {
        const __m256i q = _mm256_xor_si256(
            _mm256_loadu_si256((const __m256i*)(c + 64 * t + 32 * h)), flip);
        blk.signs[t][h] = q;
        blk.codes[t][h] = _mm256_abs_epi8(q);  // |-128| is 0x80: 128 unsigned
      }
    } else {
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      for (int t = 0; t < 4; ++t) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(c + 64 * t + 32 * h));
        blk.codes[t][h] = _mm256_and_si256(raw, low4);
        blk.codes[4 + t][h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      }
    }
    blk.d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(gb + 16 * h)));
    blk.m[h] = F == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(gb + 32 + 16 * h)))
                          : _mm256_setzero_ps();
  }
}

// acc[0..1] += row r of x times one group-block (the two halves of quant_x16_impl.h's
// x16_block_row).
template <int F>
static inline void x16_avx2_block_row(const MatmulArgs& a, const X16Avx2Block<F>& blk, int64_t r,
                                      int64_t b, __m256* acc) {
  const int64_t at = r * (a.k / kBlock) + b;
  const int32_t* high = reinterpret_cast<const int32_t*>(a.x_q8 + 2 * r * a.k + b * kBlock);
  const int32_t* low = reinterpret_cast<const int32_t*>(a.x_q8 + (2 * r + 1) * a.k + b * kBlock);
  constexpr int z = F == kQ8_0 ? 0 : zero_point<F>();  // Q8_0's codes are signed here
  __m256i hi[2], lo[2];
  for (int h = 0; h < 2; ++h) {
    hi[h] = _mm256_setzero_si256();
    lo[h] = z ? _mm256_set1_epi32(-z * a.x_q8_sums[at]) : _mm256_setzero_si256();
  }
  for (int t = 0; t < 8; ++t) {
    const __m256i xh = _mm256_set1_epi32(high[t]), xl = _mm256_set1_epi32(low[t]);
    for (int h = 0; h < 2; ++h) {
      if constexpr (F == kQ8_0) {
        hi[h] = _mm256_add_epi32(
            hi[h], dot4_avx2(blk.codes[t][h], _mm256_sign_epi8(xh, blk.signs[t][h])));
        lo[h] = _mm256_add_epi32(
            lo[h], dot4_avx2(blk.codes[t][h], _mm256_sign_epi8(xl, blk.signs[t][h])));
      } else {
        hi[h] = _mm256_add_epi32(hi[h], dot4_avx2(blk.codes[t][h], xh));
        lo[h] = _mm256_add_epi32(lo[h], dot4_avx2(blk.codes[t][h], xl));
      }
    }
  }
  const __m256 unit = _mm256_set1_ps(a.x_q8_scales[at]);
  for (int h = 0; h < 2; ++h) {
    const __m256 dot =
        _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hi[h], 8), lo[h]));
    acc[h] = _mm256_fmadd_ps(_mm256_mul_ps(blk.d[h], unit), dot, acc[h]);
    if constexpr (F == kQ4_1)
      acc[h] = _mm256_fmadd_ps(blk.m[h], _mm256_set1_ps(a.x_block_sums[at]), acc[h]);
  }
}

static inline void x16_avx2_store(const MatmulArgs& a, int64_t r, int64_t i0, const __m256* acc) {
  alignas(32) float out[16];
  _mm256_store_ps(out, acc[0]);
  _mm256_store_ps(out + 8, acc[1]);
  for (int i = 0; i < 16; ++i) store_y(a, r, i0 + i, out[i]);
}

constexpr int kX16Avx2ChunkBlocks = 8;  // group-blocks expanded at a time for many rows of x

// Weight rows [begin, end) (multiples of 16) times every row of x. Each row of x meets the
// blocks in order, one row or many, so a row's result does not depend on the batch.
template <int F>
static void gemm_x16_avx2_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  const int64_t blocks = a.k / kBlock;
  const int64_t group_bytes = blocks * x16_group_block_bytes<F>();
  X16Avx2Block<F> chunk[kX16Avx2ChunkBlocks];
  __m256 acc[kPassRows][2];
  const uint8_t* limit = a.w + end / 16 * group_bytes;
  for (int64_t i0 = begin; i0 < end; i0 += 16) {
    const uint8_t* group = a.w + i0 / 16 * group_bytes;
    for (int64_t r0 = 0; r0 < a.m; r0 += kPassRows) {
      const int64_t rows = a.m - r0 < kPassRows ? a.m - r0 : kPassRows;
      for (int64_t r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t b0 = 0; b0 < blocks; b0 += kX16Avx2ChunkBlocks) {
        const int nb = static_cast<int>(
            blocks - b0 < kX16Avx2ChunkBlocks ? blocks - b0 : kX16Avx2ChunkBlocks);
        for (int b = 0; b < nb; ++b) {
          const uint8_t* gb = group + (b0 + b) * x16_group_block_bytes<F>();
          prefetch_weights_ahead(gb, x16_group_block_bytes<F>(), limit);
          x16_avx2_expand<F>(gb, chunk[b]);
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int b = 0; b < nb; ++b)
            x16_avx2_block_row<F>(a, chunk[b], r0 + r, b0 + b, acc[r]);
      }
      for (int64_t r = 0; r < rows; ++r) x16_avx2_store(a, r0 + r, i0, acc[r]);
    }
  }
}

static void gemm_x16(const MatmulArgs& a, int64_t begin, int64_t end) {
  switch (a.format) {
    case kQ4_0X16: return gemm_x16_avx2_rows<kQ4_0>(a, begin, end);
    case kQ4_1X16: return gemm_x16_avx2_rows<kQ4_1>(a, begin, end);
    default: return gemm_x16_avx2_rows<kQ8_0>(a, begin, end);
  }
}

// 32 int32 in [-127, 127] (four vectors, in order) to 32 int8 at out.
static inline void store_codes_avx2(const __m256i* v, int8_t* out) {
  const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                           _mm256_packs_epi32(v[2], v[3]));
  // the packs work per 128-bit lane: dwords come out as v0a v1a v2a v3a | v0b v1b v2b v3b
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256((__m256i*)out, _mm256_permutevar8x32_epi32(words, order));
}

// quant_q8_impl.h's quantize_x on 8-lane vectors: the same codes, units and code sums, and the
// block sums of x added in the order of _mm512_reduce_add_ps over (x[0..15] + x[16..31]).
static void quantize_x(const uint16_t* x, int64_t stride, int64_t k, int64_t r_begin,
                       int64_t r_end, int8_t* q, float* units, int32_t* sums, float* x_sums) {
  const int64_t blocks = k / kBlock;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = r_begin; r < r_end; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* src = x + r * stride + b * kBlock;
      __m256 v[4];
      int unordered = 0;
      __m256 most = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(src + 8 * i))), 16));
        unordered |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        most = _mm256_max_ps(most, _mm256_and_ps(v[i], abs_mask));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const __m256 s = _mm256_add_ps(_mm256_add_ps(v[1], v[3]), _mm256_add_ps(v[0], v[2]));
      const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
      const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
      const int64_t at = r * blocks + b;
      int8_t* out = q + 2 * r * k + b * kBlock;
      x_sums[at] = _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
      if (skip_x_block(unordered != 0, amax, out, k, units + at, sums + at)) continue;
      const float inv = 127.0f / amax;
      const float step = amax / 127.0f;
      __m256i high[4], low[4], total = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        high[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        const __m256 rest =
            _mm256_fnmadd_ps(_mm256_cvtepi32_ps(high[i]), _mm256_set1_ps(step), v[i]);
        low[i] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, _mm256_set1_ps(256.0f * inv)));
        low[i] = _mm256_max_epi32(_mm256_min_epi32(low[i], _mm256_set1_epi32(127)),
                                  _mm256_set1_epi32(-127));
        total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_slli_epi32(high[i], 8), low[i]));
      }
      store_codes_avx2(high, out);
      store_codes_avx2(low, out + k);
      units[at] = step / 256.0f;
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(1, 0, 3, 2)));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, _MM_SHUFFLE(2, 3, 0, 1)));
      sums[at] = _mm_cvtsi128_si32(t4);
    }
  }
}
