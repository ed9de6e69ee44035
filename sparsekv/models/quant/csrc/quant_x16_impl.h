// Packed-weight matmuls on int8 activations over weights repacked in groups of 16 rows (the
// "x16" layouts of quant.h), with AVX512-VNNI integer dot products. Included by
// isa_avx512_vnni.cpp after kernel_common_impl.h (zero_point, the group-block sizes) and
// quant_q8_impl.h (the x quantization), in its namespace.
//
// In a group-block (16 weight rows, one block of 32 inputs) int32 lane i of code vector t holds
// row i's codes 4t .. 4t + 3 (4-bit formats: the low nibbles are elements 4t .. 4t + 3 and the
// high nibbles elements 16 + 4t .. 16 + 4t + 3; Q8_0: elements 4t .. 4t + 3 as q + 128), so one
// vpdpbusd against those four codes of x broadcast to every lane advances all 16 rows, the
// scales d of the 16 rows load as one vector, and every output stays in its own lane: no
// transposes, no horizontal sums. The arithmetic per row is that of quant_q8_impl.h (x in two
// int8 levels, x ~= u * (256 qh + ql)):
//   y_i = sum_blocks d_i * u * (256 sum_j q_ij qh_j + sum_j q_ij ql_j - z sum_j (256 qh_j + ql_j))
//         (+ m_i * sum_j x_j for Q4_1)
// in the same integer sums, so the results differ from the quad kernels only by the fp32
// accumulation (one lane per row here, four lanes per row there).

// The 8 code vectors of a group-block (4-bit formats: the nibbles split), lo before hi: vector
// t meets x's int32 word t of the block.
template <int F>
static inline void x16_codes(const uint8_t* gb, __m512i* codes) {
  const uint8_t* c = gb + x16_header_bytes<F>();
  if constexpr (F == kQ8_0) {
    for (int t = 0; t < 8; ++t) codes[t] = _mm512_loadu_si512(c + 64 * t);
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m512i raw = _mm512_loadu_si512(c + 64 * t);
      codes[t] = _mm512_and_si512(raw, low4);
      codes[4 + t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
    }
  }
}

// The 16 rows' scales d and (Q4_1) offsets m of a group-block as fp32 (m = 0 otherwise).
template <int F>
static inline void x16_scales(const uint8_t* gb, __m512& d, __m512& m) {
  d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)gb));
  m = F == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(gb + 32)))
                 : _mm512_setzero_ps();
}

// acc += one group-block's contribution to row r of x from its two levels' integer dot
// products with the 16 weight rows (`low` with the zero-point correction in): the scaling
// every x16 kernel shares, so their results agree bit for bit. `at`: the block of x's row.
template <int F>
static inline __m512 x16_scale_dots(const MatmulArgs& a, __m512i high, __m512i low, __m512 d,
                                    __m512 m, int64_t at, __m512 acc) {
  const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(high, 8), low));
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.x_q8_scales[at])), dot, acc);
  if constexpr (F == kQ4_1) acc = _mm512_fmadd_ps(m, _mm512_set1_ps(a.x_block_sums[at]), acc);
  return acc;
}

// acc += row r of x times one group-block (codes split, d and Q4_1's m as fp32 vectors).
template <int F>
static inline __m512 x16_block_row(const MatmulArgs& a, const __m512i* codes, __m512 d,
                                   __m512 m, int64_t r, int64_t b, __m512 acc) {
  const int64_t at = r * (a.k / kBlock) + b;
  const int32_t* high = reinterpret_cast<const int32_t*>(a.x_q8 + 2 * r * a.k + b * kBlock);
  const int32_t* low = reinterpret_cast<const int32_t*>(a.x_q8 + (2 * r + 1) * a.k + b * kBlock);
  // the high level's products and the residual's (with the zero-point correction), each in
  // two chains of four to shorten the dependent vpdpbusd sequence
  __m512i hi[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  __m512i lo[2] = {zero_point<F>() ? _mm512_set1_epi32(-zero_point<F>() * a.x_q8_sums[at])
                                   : _mm512_setzero_si512(),
                   _mm512_setzero_si512()};
  for (int t = 0; t < 8; ++t) {
    hi[t & 1] = _mm512_dpbusd_epi32(hi[t & 1], codes[t], _mm512_set1_epi32(high[t]));
    lo[t & 1] = _mm512_dpbusd_epi32(lo[t & 1], codes[t], _mm512_set1_epi32(low[t]));
  }
  return x16_scale_dots<F>(a, _mm512_add_epi32(hi[0], hi[1]), _mm512_add_epi32(lo[0], lo[1]),
                           d, m, at, acc);
}

static inline void store_group(const MatmulArgs& a, int64_t r, int64_t i0, __m512 acc) {
  alignas(64) float out[16];
  _mm512_store_ps(out, acc);
  for (int i = 0; i < 16; ++i) store_y(a, r, i0 + i, out[i]);
}

constexpr int kX16ChunkBlocks = 16;  // group-blocks split at a time for many rows (8 KiB)

// Group-blocks split for many rows of x: codes, d and Q4_1's m.
struct X16Chunk {
  __m512i codes[kX16ChunkBlocks][8];
  __m512 d[kX16ChunkBlocks], m[kX16ChunkBlocks];
};

// acc[0 .. R - 1] += rows r0 .. r0 + R - 1 of x times the chunk's blocks b0 .. b0 + nb - 1.
template <int F, int R>
static inline void x16_chunk_rows(const MatmulArgs& a, const X16Chunk& t, int64_t r0, int64_t b0,
                                  int nb, __m512* acc) {
  __m512 c[R];
  for (int r = 0; r < R; ++r) c[r] = acc[r];
  for (int b = 0; b < nb; ++b)
    for (int r = 0; r < R; ++r)
      c[r] = x16_block_row<F>(a, t.codes[b], t.d[b], t.m[b], r0 + r, b0 + b, c[r]);
  for (int r = 0; r < R; ++r) acc[r] = c[r];
}

// Weight rows [begin, end) (multiples of 16) times every row of x.
template <int F>
static void gemm_x16_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  const int64_t blocks = a.k / kBlock;
  const int64_t group_bytes = blocks * x16_group_block_bytes<F>();
  const uint8_t* limit = a.w + end / 16 * group_bytes;
  for (int64_t i0 = begin; i0 < end; i0 += 16) {
    const uint8_t* group = a.w + i0 / 16 * group_bytes;
    if (a.m == 1) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* gb = group + b * x16_group_block_bytes<F>();
        prefetch_weights_ahead(gb, x16_group_block_bytes<F>(), limit);
        __m512i codes[8];
        x16_codes<F>(gb, codes);
        __m512 d, m;
        x16_scales<F>(gb, d, m);
        acc = x16_block_row<F>(a, codes, d, m, 0, b, acc);
      }
      store_group(a, 0, i0, acc);
      continue;
    }
    X16Chunk chunk;
    small_m_passes<kX16ChunkBlocks>(
        a,
        [&](int64_t b0, int nb) {
          for (int b = 0; b < nb; ++b) {
            const uint8_t* gb = group + (b0 + b) * x16_group_block_bytes<F>();
            prefetch_weights_ahead(gb, x16_group_block_bytes<F>(), limit);
            x16_codes<F>(gb, chunk.codes[b]);
            x16_scales<F>(gb, chunk.d[b], chunk.m[b]);
          }
        },
        [&]<int R>(int64_t r, int64_t b0, int nb, __m512* acc) {
          x16_chunk_rows<F, R>(a, chunk, r, b0, nb, acc);
        },
        [&](int64_t r, __m512 acc) { store_group(a, r, i0, acc); });
  }
}

static void gemm_x16(const MatmulArgs& a, int64_t begin, int64_t end) {
  switch (a.format) {
    case kQ4_0X16: return gemm_x16_rows<kQ4_0>(a, begin, end);
    case kQ4_1X16: return gemm_x16_rows<kQ4_1>(a, begin, end);
    default: return gemm_x16_rows<kQ8_0>(a, begin, end);
  }
}
