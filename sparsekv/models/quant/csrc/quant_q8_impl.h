// Packed-weight matmuls on int8 activations with AVX512-VNNI integer dot products
// (`vpdpbusd`: 64 unsigned-byte x signed-byte products per instruction, summed in fours into
// int32 lanes). Formats Q4_0, Q4_1, Q8_0 (layouts in quant.h). Included by isa_avx512_vnni.cpp
// after quant_impl.h and kernel_common_impl.h (zero_point, skip_x_block), in the same namespace.
//
// bf16 activations are first quantized per block of 32 in two int8 levels: the high codes as
// llama.cpp quantizes activations for its 4- and 8-bit dot products (its Q8_0 activation
// blocks; symmetric absmax), qh = round(x * 127 / max|x|), then the residual in units of
// 1/256 of that step, ql = round((x - qh * max|x| / 127) * 256 * 127 / max|x|), so that
// x ~= u * (256 qh + ql) with u = max|x| / (127 * 256): about 15 bits per block, finer than
// bf16's 8-bit mantissa for the block's large values (one level alone cost SmolLM2 ~4% of its
// greedy agreement with fp32). A block then costs integer products only, exact in int32
// (|256 sum q qh| < 2^28):
//   y = sum_blocks d * u * (256 sum_j q_j qh_j + sum_j q_j ql_j - z sum_j (256 qh_j + ql_j))
//       (+ m * sum_j x_j for Q4_1)
// with the weight codes q as unsigned bytes (4-bit codes 0..15; Q8_0's int8 codes + 128) and z
// the zero point those unsigned codes carry (Q4_0: 8, Q8_0: 128, Q4_1: 0; Q4_1's offset m
// multiplies the exact sum of the block's bf16 x). The only error beyond fp32 accumulation is
// x's rounding: |y - x W^T| <= sum_blocks u * sum_j |d q_j - d z| (u / 2 but where the
// residual saturates at 127).
//
// Four weight rows share the lanes of one vector (a "quad"): 128-bit lane g holds row g's 16
// codes of one half of a block, met by the same 16 bytes of qx broadcast to every lane, so a
// block costs each row of x four vpdpbusd (two per level), one conversion and one scaling FMA
// for four weight rows. One row of x and many run the same per-row arithmetic in the same
// order, so a row's result does not depend on how many rows share the call.

constexpr int64_t kQ8PrefetchRows = 16;  // weight rows prefetched ahead (as the bf16 kernels)
constexpr int kQ8ChunkBlocks = 32;       // blocks of a quad expanded at a time (8 KiB)

// One block of a quad: the codes of elements 0-15 (lo) and 16-31 (hi) of row g in 128-bit
// lane g, row g's scale d in lanes 4g .. 4g + 3, and Q4_1's offset m in lane 4g (0 elsewhere
// and for the other formats).
struct Q8Block {
  __m512i lo, hi;
  __m512 scale, offset;
};

// The 16 bytes at p broadcast to every 128-bit lane.
static inline __m512i splat16(const int8_t* p) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p));
}

// Block b of weight rows i0 .. i0 + nr - 1 (nr <= 4; the missing rows' codes and scales are 0).
template <int F>
static inline Q8Block expand_q8(const MatmulArgs& a, int64_t i0, int nr, int64_t b) {
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  int32_t head[4] = {0, 0, 0, 0};  // fp16 d (low half), Q4_1's m (high half)
  for (int g = 0; g < nr; ++g) {
    const uint8_t* blk = a.w + (i0 + g) * a.row_bytes + b * block_bytes<F>();
    _mm_prefetch((const char*)(blk + kQ8PrefetchRows * a.row_bytes), _MM_HINT_T0);
    if constexpr (F == kQ8_0) {
      lo = _mm512_inserti32x4(lo, _mm_loadu_si128((const __m128i*)(blk + 2)), g);
      hi = _mm512_inserti32x4(hi, _mm_loadu_si128((const __m128i*)(blk + 18)), g);
    } else {  // byte j holds element j (low nibble) and element j + 16 (high nibble)
      lo = _mm512_inserti32x4(lo, _mm_loadu_si128((const __m128i*)(blk + (F == kQ4_1 ? 4 : 2))),
                              g);
    }
    if constexpr (F == kQ4_1) {
      __builtin_memcpy(&head[g], blk, 4);
    } else {
      uint16_t d;
      __builtin_memcpy(&d, blk, 2);
      head[g] = d;
    }
  }
  Q8Block out;
  if constexpr (F == kQ8_0) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // int8 q -> q + 128
    out.lo = _mm512_xor_si512(lo, flip);
    out.hi = _mm512_xor_si512(hi, flip);
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    out.lo = _mm512_and_si512(lo, low4);
    out.hi = _mm512_and_si512(_mm512_srli_epi16(lo, 4), low4);
  }
  // [d0, m0, d1, m1, d2, m2, d3, m3] as fp32
  const __m512i scale_lanes = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i offset_lanes = _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7);
  const __m128i halves = _mm_setr_epi32(head[0], head[1], head[2], head[3]);
  const __m512 h = _mm512_castps256_ps512(_mm256_cvtph_ps(halves));
  out.scale = _mm512_permutexvar_ps(scale_lanes, h);
  out.offset = F == kQ4_1 ? _mm512_maskz_permutexvar_ps(0x1111, offset_lanes, h)
                          : _mm512_setzero_ps();
  return out;
}

// acc += row r of x times block b of the quad.
template <int F>
static inline __m512 q8_block_row(const MatmulArgs& a, const Q8Block& w, int64_t r, int64_t b,
                                  __m512 acc) {
  const int64_t at = r * (a.k / kBlock) + b;
  const int8_t* high = a.x_q8 + 2 * r * a.k + b * kBlock;
  const int8_t* low = high + a.k;
  // -z * sum(256 qh + ql) in lane 4g of every row's group: the unsigned codes' zero point
  __m512i lo = zero_point<F>() ? _mm512_maskz_set1_epi32(0x1111, -zero_point<F>() * a.x_q8_sums[at])
                               : _mm512_setzero_si512();
  __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w.lo, splat16(high));
  hi = _mm512_dpbusd_epi32(hi, w.hi, splat16(high + 16));
  lo = _mm512_dpbusd_epi32(lo, w.lo, splat16(low));
  lo = _mm512_dpbusd_epi32(lo, w.hi, splat16(low + 16));
  const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo));
  const __m512 scale = _mm512_mul_ps(w.scale, _mm512_set1_ps(a.x_q8_scales[at]));
  acc = _mm512_fmadd_ps(scale, dot, acc);
  if constexpr (F == kQ4_1)
    acc = _mm512_fmadd_ps(w.offset, _mm512_set1_ps(a.x_block_sums[at]), acc);
  return acc;
}

// One row of x: each block of a quad is expanded in registers and used at once.
template <int F>
static void gemv_q8_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  const int64_t blocks = a.k / kBlock;
  for (int64_t i0 = begin; i0 < end; i0 += 4) {
    const int nr = static_cast<int>(end - i0 < 4 ? end - i0 : 4);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b)
      acc = q8_block_row<F>(a, expand_q8<F>(a, i0, nr, b), 0, b, acc);
    store_quad(a, 0, i0, nr, acc);
  }
}

// acc[0 .. R - 1] += rows r0 .. r0 + R - 1 of x times blocks b0 .. b0 + nb - 1 (R independent
// accumulator chains hide the FMA latency).
template <int F, int R>
static inline void q8_chunk_rows(const MatmulArgs& a, const Q8Block* chunk, int64_t r0,
                                 int64_t b0, int nb, __m512* acc) {
  __m512 c[R];
  for (int r = 0; r < R; ++r) c[r] = acc[r];
  for (int b = 0; b < nb; ++b)
    for (int r = 0; r < R; ++r) c[r] = q8_block_row<F>(a, chunk[b], r0 + r, b0 + b, c[r]);
  for (int r = 0; r < R; ++r) acc[r] = c[r];
}

// Several rows of x: each quad's blocks are expanded a chunk at a time (on the stack, in L1)
// and multiplied with up to 64 rows of x, four at a time (small_m_passes).
template <int F>
static void gemm_q8_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  Q8Block chunk[kQ8ChunkBlocks];
  for (int64_t i0 = begin; i0 < end; i0 += 4) {
    const int nr = static_cast<int>(end - i0 < 4 ? end - i0 : 4);
    small_m_passes<kQ8ChunkBlocks>(
        a,
        [&](int64_t b0, int nb) {
          for (int b = 0; b < nb; ++b) chunk[b] = expand_q8<F>(a, i0, nr, b0 + b);
        },
        [&]<int R>(int64_t r, int64_t b0, int nb, __m512* acc) {
          q8_chunk_rows<F, R>(a, chunk, r, b0, nb, acc);
        },
        [&](int64_t r, __m512 acc) { store_quad(a, r, i0, nr, acc); });
  }
}

constexpr unsigned kQ8Formats = (1u << kQ4_0) | (1u << kQ4_1) | (1u << kQ8_0);

static void gemm_q8(const MatmulArgs& a, int64_t begin, int64_t end) {
  const bool one = a.m == 1;
  switch (a.format) {
    case kQ4_0:
      return one ? gemv_q8_rows<kQ4_0>(a, begin, end) : gemm_q8_rows<kQ4_0>(a, begin, end);
    case kQ4_1:
      return one ? gemv_q8_rows<kQ4_1>(a, begin, end) : gemm_q8_rows<kQ4_1>(a, begin, end);
    default:
      return one ? gemv_q8_rows<kQ8_0>(a, begin, end) : gemm_q8_rows<kQ8_0>(a, begin, end);
  }
}

// Rows [r_begin, r_end) of bf16 x [m, k] (row stride `stride`) quantized per block of 32 in two
// levels: q [m, 2k] (per row the k high codes, then the k residual codes), units [m, k / 32]
// (u), sums [m, k / 32] (of 256 qh + ql over the block) and x_sums [m, k / 32] (fp32 sum of the
// block's bf16 values). A block of zeros (or of values all below kTinyBlock) gets u = 0 and zero
// codes; one holding a NaN or an infinity gets zero codes and u = NaN.
static void quantize_x(const uint16_t* x, int64_t stride, int64_t k, int64_t r_begin,
                       int64_t r_end, int8_t* q, float* units, int32_t* sums, float* x_sums) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = r_begin; r < r_end; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* src = x + r * stride + b * kBlock;
      __m512 v[2];
      for (int h = 0; h < 2; ++h)
        v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + 16 * h))), 16));
      const bool nan = _mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) |
                       _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q);
      const float amax =
          _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
      const int64_t at = r * blocks + b;
      int8_t* out = q + 2 * r * k + b * kBlock;
      x_sums[at] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      if (skip_x_block(nan, amax, out, k, units + at, sums + at)) continue;
      const float inv = 127.0f / amax;
      const float step = amax / 127.0f;
      __m512i total = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)));
        // x - qh * step, rounded once; then in units of step / 256, saturated to int8
        const __m512 rest =
            _mm512_fnmadd_ps(_mm512_cvtepi32_ps(high), _mm512_set1_ps(step), v[h]);
        __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(rest, _mm512_set1_ps(256.0f * inv)));
        low = _mm512_max_epi32(_mm512_min_epi32(low, _mm512_set1_epi32(127)),
                               _mm512_set1_epi32(-127));
        _mm_storeu_si128((__m128i*)(out + 16 * h), _mm512_cvtsepi32_epi8(high));
        _mm_storeu_si128((__m128i*)(out + k + 16 * h), _mm512_cvtsepi32_epi8(low));
        total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_slli_epi32(high, 8), low));
      }
      units[at] = step / 256.0f;
      sums[at] = _mm512_reduce_add_epi32(total);
    }
  }
}
