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

// The small-M GEMM puts four weight rows in the lanes of one vector (a "quad"), so that a block
// costs each row of x four vdpbf16ps and one scaling FMA for four weight rows, and no
// horizontal sum until the row's end. Row g's 32 codes take 128-bit lane g of four vectors:
// vector s holds its bf16 pairs 4s .. 4s + 3 (elements 8s .. 8s + 7), met by the same eight
// elements of x broadcast to every lane. Lane l of row g's lane then sums the pairs
// l, 4 + l, 8 + l, 12 + l of every block, scaled per block by d (and Q4_1's offset m * sum(x
// block) added in lane 0); the row's four lanes are added at the end.
constexpr int kQuadChunkBlocks = 32;  // blocks of a quad expanded at a time (12 KiB)

// One expanded chunk of a quad: per block the four code vectors, the scale d of row g in lane
// group g, and Q4_1's offset m of row g in lane 4g (0 elsewhere and for the other formats).
struct QuadChunk {
  __m512i codes[kQuadChunkBlocks][4];
  __m512 scale[kQuadChunkBlocks];
  __m512 offset[kQuadChunkBlocks];
};

// Expands blocks [b0, b0 + nb) of weight rows i0 .. i0 + nr - 1 (nr <= 4; missing rows are 0).
template <int F>
static void expand_quad(const MatmulArgs& a, const BlockCodes<F>& codes, int64_t i0, int nr,
                        int64_t b0, int nb, QuadChunk& t) {
  const __m512i scale_lanes = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i offset_lanes = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);
  for (int b = 0; b < nb; ++b) {
    __m512i r[4];
    int32_t head[4] = {0, 0, 0, 0};  // fp16 d (low half), Q4_1's m (high half)
    for (int g = 0; g < 4; ++g) {
      if (g < nr) {
        const uint8_t* blk = a.w + (i0 + g) * a.row_bytes + (b0 + b) * block_bytes<F>();
        _mm_prefetch((const char*)(blk + kPrefetchRows * a.row_bytes), _MM_HINT_T0);
        r[g] = (__m512i)codes(blk);
        if constexpr (F == kQ4_1) {
          __builtin_memcpy(&head[g], blk, 4);
        } else {
          uint16_t d;
          __builtin_memcpy(&d, blk, 2);
          head[g] = d;
        }
      } else {
        r[g] = _mm512_setzero_si512();
      }
    }
    // 4 x 4 transpose of 128-bit lanes: vector s, lane g <- row g, lane s
    const __m512i t0 = _mm512_shuffle_i32x4(r[0], r[1], 0x44);  // r0.0 r0.1 r1.0 r1.1
    const __m512i t1 = _mm512_shuffle_i32x4(r[0], r[1], 0xEE);  // r0.2 r0.3 r1.2 r1.3
    const __m512i t2 = _mm512_shuffle_i32x4(r[2], r[3], 0x44);
    const __m512i t3 = _mm512_shuffle_i32x4(r[2], r[3], 0xEE);
    t.codes[b][0] = _mm512_shuffle_i32x4(t0, t2, 0x88);  // r0.0 r1.0 r2.0 r3.0
    t.codes[b][1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);  // r0.1 r1.1 r2.1 r3.1
    t.codes[b][2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    t.codes[b][3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
    // [d0, m0, d1, m1, d2, m2, d3, m3] as fp32
    const __m128i halves = _mm_setr_epi32(head[0], head[1], head[2], head[3]);
    const __m512 h = _mm512_castps256_ps512(_mm256_cvtph_ps(halves));
    t.scale[b] = _mm512_permutexvar_ps(scale_lanes, h);
    t.offset[b] = F == kQ4_1 ? _mm512_maskz_permutexvar_ps(0x1111, offset_lanes, h)
                             : _mm512_setzero_ps();
  }
}

// The eight bf16 elements at x broadcast to every 128-bit lane.
static inline __m512bh lane_splat(const uint16_t* x) {
  return (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)x));
}

// acc[r] += rows r0 .. r0 + R - 1 of x times the chunk (blocks b0 .. b0 + nb - 1).
template <int F, int R>
static inline void quad_rows(const MatmulArgs& a, const QuadChunk& t, int64_t r0, int64_t b0,
                             int nb, __m512* acc) {
  const int64_t blocks = a.k / kBlock;
  __m512 c[R];
  for (int r = 0; r < R; ++r) c[r] = acc[r];
  for (int b = 0; b < nb; ++b) {
    const __m512bh w0 = (__m512bh)t.codes[b][0], w1 = (__m512bh)t.codes[b][1];
    const __m512bh w2 = (__m512bh)t.codes[b][2], w3 = (__m512bh)t.codes[b][3];
    for (int r = 0; r < R; ++r) {
      const uint16_t* x = a.x_bf16 + (r0 + r) * a.x_stride + (b0 + b) * kBlock;
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, lane_splat(x));
      s = _mm512_dpbf16_ps(s, w1, lane_splat(x + 8));
      s = _mm512_dpbf16_ps(s, w2, lane_splat(x + 16));
      s = _mm512_dpbf16_ps(s, w3, lane_splat(x + 24));
      c[r] = _mm512_fmadd_ps(t.scale[b], s, c[r]);
      if constexpr (F == kQ4_1) {
        const float sum = a.x_block_sums[(r0 + r) * blocks + b0 + b];
        c[r] = _mm512_fmadd_ps(t.offset[b], _mm512_set1_ps(sum), c[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = c[r];
}

// Weight rows go in quads; each quad's blocks are expanded a chunk at a time and multiplied
// with up to 64 rows of x, four at a time, whose accumulators persist across the chunks.
template <int F>
static void gemm_bf16_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  const BlockCodes<F> codes;
  QuadChunk chunk;
  for (int64_t i0 = begin; i0 < end; i0 += 4) {
    const int nr = static_cast<int>(end - i0 < 4 ? end - i0 : 4);
    small_m_passes<kQuadChunkBlocks>(
        a, [&](int64_t b0, int nb) { expand_quad<F>(a, codes, i0, nr, b0, nb, chunk); },
        [&]<int R>(int64_t r, int64_t b0, int nb, __m512* acc) {
          quad_rows<F, R>(a, chunk, r, b0, nb, acc);
        },
        [&](int64_t r, __m512 acc) { store_quad(a, r, i0, nr, acc); });
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
