// Packed-weight GEMV and small-M GEMM taking bf16 activations, with AVX512-BF16 dot products
// (`vdpbf16ps`: 32 bf16 products per instruction, fp32 accumulation). Formats Q4_0, Q4_1, Q8_0
// (layouts in quant.h). Included by isa_avx512_bf16.cpp after quant_impl.h, in the same
// namespace (block_bytes, half_to_float, kBlock).
//
// Each block's 32 codes are expanded to bf16 in registers: the codes (0..15, or -128..127) are
// exact in bf16, so every product code * x is exact in fp32 and the kernels differ from an fp32
// dot product of the dequantized weight only by the fp32 accumulation order:
//   y = sum_blocks d * sum_j(q_j x_j)  (+ m * sum_j x_j for Q4_1, from x_block_sums).
// Q4_0's zero point 8 is folded into its code table (q - 8 is exact in bf16), so it needs no
// block sums.

// Shift counts of vpsrlvw: lanes 0-15 keep the byte (low nibble), lanes 16-31 take its high
// nibble (GGML order: byte j holds elements j and j + 16).
static inline __m512i nibble_shifts() {
  return _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
}

// vpermw table: entry i holds bf16(code (i & 15) minus the zero point), as the index is the low
// 5 bits of a lane holding a whole byte (low nibble) or a high nibble.
static inline __m512i nibble_table(float zero_point) {
  const __m512 codes = _mm512_sub_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_ps(zero_point));
  return (__m512i)_mm512_cvtne2ps_pbh(codes, codes);
}

// The 32 codes of a 4-bit block (16 bytes of nibbles at qs) as bf16, in element order.
static inline __m512bh nibble_codes(const uint8_t* qs, __m512i table, __m512i shifts) {
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)qs));
  const __m512i words = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(bytes), shifts);
  return (__m512bh)_mm512_permutexvar_epi16(words, table);
}

// The 32 int8 codes at qs as bf16 (int8 -> int32 -> fp32, all exact, then packed).
static inline __m512bh int8_codes(const uint8_t* qs) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qs)));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qs + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 from lo, 16-31 from hi
}

// Code expansion of format F, set up once per call.
template <int F>
struct BlockCodes {
  __m512i table = nibble_table(F == kQ4_0 ? 8.0f : 0.0f), shifts = nibble_shifts();
  // Codes of the block at blk as bf16.
  __m512bh operator()(const uint8_t* blk) const {
    if constexpr (F == kQ8_0) return int8_codes(blk + 2);
    return nibble_codes(blk + (F == kQ4_1 ? 4 : 2), table, shifts);
  }
  // The block's offset term c (w = d q + c): Q4_1's m; 0 for the others (folded in the table).
  static float offset(const uint8_t* blk) { return F == kQ4_1 ? half_to_float(blk + 2) : 0.0f; }
};

static inline uint16_t round_bf16(float value) {
  uint32_t bits;
  __builtin_memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // nearest even
}

// y[r, col + i] <- value (+ bias[i]), rounded once to bf16 when y is bf16.
static inline void store_y(const MatmulArgs& a, int64_t r, int64_t i, float value) {
  if (a.bias) value += a.bias[i];
  const int64_t at = r * a.y_stride + a.col + i;
  if (a.y_bf16) {
    a.y_bf16[at] = round_bf16(value);
  } else {
    a.y[at] = value;
  }
}

// Weight rows this far ahead are prefetched: decode streams every layer's weight from memory,
// and without it the 4-bit GEMV's four interleaved row streams ran 1.5-2x slower there
// (1536 x 576 and 576 x 1536 Q4_1, one thread, weights cycled through 110 MB).
constexpr int64_t kPrefetchRows = 16;

// Q4_1's block header [d, m] (two fp16) as fp32 lanes 0 and 1 of one vector: one load and one
// conversion for both.
static inline __m128 scale_and_min(const uint8_t* blk) {
  int32_t bits;
  __builtin_memcpy(&bits, blk, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

// Weight rows [i0, i0 + R) times the one row of x; R independent accumulator chains. Q4_1's
// offsets m * sum(x block) accumulate in lane 1 of a vector per row, next to the scale d that
// lane 0 carries (the header converted once), instead of a scalar chain per row.
template <int F, int R>
static inline void gemv_group(const MatmulArgs& a, const BlockCodes<F>& codes, int64_t i0) {
  __m512 acc[R];
  __m128 offsets[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    offsets[r] = _mm_setzero_ps();
  }
  const uint8_t* row0 = a.w + i0 * a.row_bytes;
  for (int64_t b = 0; b < a.k / kBlock; ++b) {
    const __m512bh x = (__m512bh)_mm512_loadu_si512(a.x_bf16 + b * kBlock);
    // Q4_1: [0, sum(x block), 0, 0], so lane 1 of [d, m] * it is the block's offset term.
    const __m128 sums =
        F == kQ4_1 ? _mm_set_ps(0.0f, 0.0f, a.x_block_sums[b], 0.0f) : _mm_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = row0 + r * a.row_bytes + b * block_bytes<F>();
      _mm_prefetch((const char*)(blk + kPrefetchRows * a.row_bytes), _MM_HINT_T0);
      const __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), codes(blk), x);
      if constexpr (F == kQ4_1) {
        const __m128 dm = scale_and_min(blk);
        acc[r] = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), dot, acc[r]);
        offsets[r] = _mm_fmadd_ps(dm, sums, offsets[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(half_to_float(blk)), dot, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float offset = _mm_cvtss_f32(_mm_shuffle_ps(offsets[r], offsets[r], 1));
    store_y(a, 0, i0 + r, _mm512_reduce_add_ps(acc[r]) + offset);
  }
}

template <int F>
static void gemv_bf16_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  const BlockCodes<F> codes;
  int64_t i = begin;
  // Q8_0 rows (612 bytes at k = 576: an output head streamed from memory) go one at a time:
  // four interleaved row streams measured 1.7x slower there. The 4-bit rows go in fours, so
  // four independent accumulator chains hide the fused multiply-add latency.
  if constexpr (F != kQ8_0)
    for (; i + 4 <= end; i += 4) gemv_group<F, 4>(a, codes, i);
  for (; i < end; ++i) gemv_group<F, 1>(a, codes, i);
}

constexpr int kBf16TileRows = 4;        // weight rows expanded together
constexpr int kBf16ChunkBlocks = 16;    // at most this many blocks of 32 per expanded tile
constexpr int64_t kBf16PassRows = 64;   // rows of x whose partial sums stay on the stack

// One expanded tile: kBf16TileRows weight rows x nb blocks of bf16 codes (4 KiB), with each
// block's scale and offset; rows past the last weight row hold zeros.
struct Bf16Tile {
  __m512bh codes[kBf16TileRows][kBf16ChunkBlocks];
  alignas(64) float scale[kBf16TileRows][kBf16ChunkBlocks];
  alignas(64) float offset[kBf16TileRows][kBf16ChunkBlocks];
};

template <int F>
static void expand_tile(const MatmulArgs& a, const BlockCodes<F>& codes, int64_t i0, int nr,
                        int64_t b0, int nb, Bf16Tile& t) {
  for (int i = 0; i < kBf16TileRows; ++i) {
    for (int b = 0; b < kBf16ChunkBlocks; ++b) {
      const bool live = i < nr && b < nb;
      const uint8_t* blk = a.w + (i0 + i) * a.row_bytes + (b0 + b) * block_bytes<F>();
      t.codes[i][b] = live ? codes(blk) : (__m512bh)_mm512_setzero_si512();
      t.scale[i][b] = live ? half_to_float(blk) : 0.0f;
      t.offset[i][b] = live ? codes.offset(blk) : 0.0f;
    }
  }
}

// part[r][i] += x rows r0, r0 + 1 (x1 may repeat x0; its sums are then dropped) times the tile.
template <int F>
static inline void tile_rows(const MatmulArgs& a, const Bf16Tile& t, int64_t r0, bool pair,
                             int64_t b0, int nb, float (*part)[kBf16TileRows]) {
  const uint16_t* x0 = a.x_bf16 + r0 * a.x_stride + b0 * kBlock;
  const uint16_t* x1 = pair ? x0 + a.x_stride : x0;
  __m512 c0[kBf16TileRows], c1[kBf16TileRows];
  for (int i = 0; i < kBf16TileRows; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const __m512bh xa = (__m512bh)_mm512_loadu_si512(x0 + b * kBlock);
    const __m512bh xb = (__m512bh)_mm512_loadu_si512(x1 + b * kBlock);
    for (int i = 0; i < kBf16TileRows; ++i) {
      const __m512 d = _mm512_set1_ps(t.scale[i][b]);
      c0[i] = _mm512_fmadd_ps(d, _mm512_dpbf16_ps(_mm512_setzero_ps(), t.codes[i][b], xa), c0[i]);
      c1[i] = _mm512_fmadd_ps(d, _mm512_dpbf16_ps(_mm512_setzero_ps(), t.codes[i][b], xb), c1[i]);
    }
  }
  if constexpr (F == kQ4_1) {  // sum_b m[i][b] * sum(x block b), 16 blocks per instruction
    const __mmask16 live = static_cast<__mmask16>((1u << nb) - 1);
    const int64_t blocks = a.k / kBlock;
    const __m512 s0 = _mm512_maskz_loadu_ps(live, a.x_block_sums + r0 * blocks + b0);
    const __m512 s1 = _mm512_maskz_loadu_ps(live, a.x_block_sums + (r0 + pair) * blocks + b0);
    for (int i = 0; i < kBf16TileRows; ++i) {
      const __m512 m = _mm512_load_ps(t.offset[i]);
      c0[i] = _mm512_fmadd_ps(m, s0, c0[i]);
      c1[i] = _mm512_fmadd_ps(m, s1, c1[i]);
    }
  }
  for (int i = 0; i < kBf16TileRows; ++i) {
    part[0][i] += _mm512_reduce_add_ps(c0[i]);
    if (pair) part[1][i] += _mm512_reduce_add_ps(c1[i]);
  }
}

// Tiles of 4 weight rows x up to 16 blocks are expanded once per pass of up to 64 rows of x and
// multiplied with each of them, two rows of x at a time.
template <int F>
static void gemm_bf16_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  const BlockCodes<F> codes;
  Bf16Tile tile;
  float part[kBf16PassRows][kBf16TileRows];
  const int64_t blocks = a.k / kBlock;
  // Equal chunks (18 blocks: 2 x 9, not 16 + 2) so each chunk's fixed cost is spread evenly.
  const int64_t chunks = (blocks + kBf16ChunkBlocks - 1) / kBf16ChunkBlocks;
  const int64_t chunk = chunks ? (blocks + chunks - 1) / chunks : 0;
  for (int64_t i0 = begin; i0 < end; i0 += kBf16TileRows) {
    const int nr = static_cast<int>(end - i0 < kBf16TileRows ? end - i0 : kBf16TileRows);
    for (int64_t r0 = 0; r0 < a.m; r0 += kBf16PassRows) {
      const int64_t rows = a.m - r0 < kBf16PassRows ? a.m - r0 : kBf16PassRows;
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < kBf16TileRows; ++i) part[r][i] = 0.0f;
      for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
        const int nb = static_cast<int>(blocks - b0 < chunk ? blocks - b0 : chunk);
        expand_tile<F>(a, codes, i0, nr, b0, nb, tile);
        for (int64_t r = 0; r < rows; r += 2)
          tile_rows<F>(a, tile, r0 + r, r + 1 < rows, b0, nb, part + r);
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < nr; ++i) store_y(a, r0 + r, i0 + i, part[r][i]);
    }
  }
}

constexpr unsigned kBf16Formats = (1u << kQ4_0) | (1u << kQ4_1) | (1u << kQ8_0);

static void gemv_bf16(const MatmulArgs& a, int64_t begin, int64_t end) {
  switch (a.format) {
    case kQ4_0: return gemv_bf16_rows<kQ4_0>(a, begin, end);
    case kQ4_1: return gemv_bf16_rows<kQ4_1>(a, begin, end);
    default: return gemv_bf16_rows<kQ8_0>(a, begin, end);
  }
}
static void gemm_bf16(const MatmulArgs& a, int64_t begin, int64_t end) {
  switch (a.format) {
    case kQ4_0: return gemm_bf16_rows<kQ4_0>(a, begin, end);
    case kQ4_1: return gemm_bf16_rows<kQ4_1>(a, begin, end);
    default: return gemm_bf16_rows<kQ8_0>(a, begin, end);
  }
}
