// KIVI int4 pages (part of kernel_impl.h): nibble unpacking, fp16 scales, and the per-page
// algebra that lets decode work on the codes without dequantizing them.
//
// Layout (kernels.h): codes [num_pages, 2, num_kv_heads, block_size, head_dim / 2] bytes, two
// per byte, the even element in the low nibble; keys per channel, k[j][c] = code * ks[c] +
// kz[c] with ks, kz [num_pages, num_kv_heads, head_dim] fp16; values per slot, v[j][c] = code *
// vs[j] + vz[j] with vs, vz [num_pages, num_kv_heads, block_size] fp16.
//
// Logits: q . k_j = sum_c (q_c * ks_c) * code_jc + sum_c q_c * kz_c. Per page and block of query
// heads the query is multiplied by the page's key scales once and the zeros give one bias per
// head (int4_page_query); each slot then costs a dot product with its codes, as for int8.
// Values: sum_j p_j v_j = sum_j (p_j * vs_j) * code_j + sum_j p_j * vz_j. The probabilities
// times the slot scales weigh the code rows, and the second sum, one number per head and tile,
// is added to every channel of the accumulator (int4_value_coefficients, value_pass).
//
// Unpacking: a chunk of 2W elements is W bytes, zero-extended to W 32-bit lanes; `lane & 15` is
// then the chunk's even elements and `lane >> 4` its odd ones, bf16's chunk order (chunk_pos),
// in which the query, the key scales and zeros and the accumulators are kept. The widening is
// one vpmovzxbd where the unit has AVX2 / AVX-512 (SKV_AVX2, SKV_AVX512: intrinsics, since GCC
// 12 lowers a __builtin_convertvector of bytes, or a widening __builtin_shufflevector, to scalar
// code or a trip through the stack); the generic unit assembles the lanes from bytes. (Words of
// 4 codes per lane, as int8 reads them, would need head_dim a multiple of 8W: 128 on AVX-512.)
//
// fp16 scales: per page and per slot, so their conversion is a small cost (~5% of a slot's time
// when converted with integer operations); F16C (vcvtph2ps) does the key scales where the unit
// has it, plain integer operations (half_to_float) the rest.

// W code bytes -> W 32-bit lanes, zero-extended (lane l = byte l).
static inline vu widen_bytes(const uint8_t* p) {
#if defined(SKV_AVX512) && SKV_W == 16
  return (vu)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(SKV_AVX2) && SKV_W == 8
  return (vu)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif defined(SKV_AVX2) && SKV_W == 16  // avx2_w16: a vector is two ymm registers
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  vu x;
  __builtin_memcpy(&x, &lo, sizeof(lo));
  __builtin_memcpy(reinterpret_cast<char*>(&x) + sizeof(lo), &hi, sizeof(hi));
  return x;
#else
  vu x;
  for (int l = 0; l < W; ++l) x[l] = p[l];
  return x;
#endif
}

// Chunk c (a multiple of 2W) of a row of int4 codes: even elements in a, odd ones in b.
static inline void load_chunk(const int4x2* row, int64_t c, vf& a, vf& b) {
  const vu x = widen_bytes(&row[c / 2].bits);
  a = __builtin_convertvector((vi)(x & 15u), vf);
  b = __builtin_convertvector((vi)(x >> 4), vf);
}

// fp16 bit patterns (the low 16 bits of each lane, the rest zero) -> fp32, exactly. Subnormals
// go through an integer conversion rather than a denormal fp32 operand, which DAZ would flush
// and which costs a microcode assist: KIVI's scale floor, 2^-24, is one.
static inline vf half_to_float(vu h) {
  const vu em = h & 0x7fffu;
  const vf normal = (vf)((em << 13) + 0x38000000u);  // exponent bias 15 -> 127
  const vf tiny = __builtin_convertvector((vi)em, vf) * splat(0x1p-24f);
  const vf special = (vf)((em << 13) | 0x7f800000u);  // inf, NaN
  vf r = em < 0x400u ? tiny : normal;
  r = em >= 0x7c00u ? special : r;
  return (vf)((vu)r | ((h & 0x8000u) << 16));
}

#if defined(SKV_AVX512) || defined(SKV_AVX2)
// W fp16 values -> fp32 in order, by F16C's vcvtph2ps.
static inline vf load_halves(const uint16_t* p) {
#if defined(SKV_AVX512) && SKV_W == 16
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif SKV_W == 8
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else  // avx2_w16
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  vf x;
  __builtin_memcpy(&x, &lo, sizeof(lo));
  __builtin_memcpy(reinterpret_cast<char*>(&x) + sizeof(lo), &hi, sizeof(hi));
  return x;
#endif
}
#endif

// 2W fp16 values: the even ones in a, the odd ones in b. F16C converts them in order and two
// shuffles split them where the unit has it; the generic unit reads them as W words of two.
static inline void load_half_pairs(const uint16_t* p, vf& a, vf& b) {
#if defined(SKV_AVX512) || defined(SKV_AVX2)
  const vf lo = load_halves(p), hi = load_halves(p + W);
#if SKV_W == 16
  a = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  b = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  a = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14);
  b = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
#else
  vu x;
  __builtin_memcpy(&x, p, sizeof(x));
  a = half_to_float(x & 0xffffu);
  b = half_to_float(x >> 16);
#endif
}

// The query of g heads (chunk order, base-2 scaled) for the keys of (page, head) ph =
// page * num_kv_heads + kvh: qs[h] = q[h] * key scales, bias[h] = q[h] . key zeros.
template <int g>
static inline void int4_page_query(const DecodeArgs& a, int64_t ph, const float* q, float* qs,
                                   float* bias) {
  const int64_t d = a.head_dim;
  const uint16_t* ks = a.key_scale + ph * d;
  const uint16_t* kz = a.key_zero + ph * d;
  vf acc[g];
  for (int h = 0; h < g; ++h) acc[h] = splat(0.0f);
  for (int64_t c = 0; c < d; c += 2 * W) {
    vf se, so, ze, zo;
    load_half_pairs(ks + c, se, so);
    load_half_pairs(kz + c, ze, zo);
    for (int h = 0; h < g; ++h) {
      const vf qe = loadu(q + h * d + c), qo = loadu(q + h * d + c + W);
      storeu(qs + h * d + c, qe * se);
      storeu(qs + h * d + c + W, qo * so);
      acc[h] += qe * ze + qo * zo;
    }
  }
  for (int h = 0; h < g; ++h) bias[h] = hsum(acc[h]);
}

// Value scales and zeros of slots [j0, j0 + n) of (page, head) ph, staged as fp16 bit patterns
// widened to 32-bit words in vs, vz (float buffers: int4_value_coefficients converts them).
static inline void int4_stage_values(const DecodeArgs& a, int64_t ph, int64_t j0, int64_t n,
                                     float* vs, float* vz) {
  const uint16_t* s = a.value_scale + ph * a.block_size + j0;
  const uint16_t* z = a.value_zero + ph * a.block_size + j0;
  for (int64_t t = 0; t < n; ++t) {
    const uint32_t sb = s[t], zb = z[t];
    __builtin_memcpy(vs + t, &sb, 4);
    __builtin_memcpy(vz + t, &zb, 4);
  }
}

// Value coefficients of a tile of n staged slots for g heads: zsum[h] = sum_t p[h][t] * vz[t],
// then p[h][t] *= vs[t]. Converts vs, vz in place (zero from n up to the next multiple of W,
// where the probabilities are zero too).
static inline void int4_value_coefficients(int g, int64_t n, float* sc, int64_t ss, float* vs,
                                           float* vz, float* zsum) {
  const int64_t nv = (n + W - 1) / W * W;
  for (int64_t t = n; t < nv; ++t) vs[t] = vz[t] = 0.0f;  // +0.0f: bits 0, fp16 zero
  for (int64_t t = 0; t < nv; t += W) {
    vu s, z;
    __builtin_memcpy(&s, vs + t, sizeof(s));
    __builtin_memcpy(&z, vz + t, sizeof(z));
    storeu(vs + t, half_to_float(s));
    storeu(vz + t, half_to_float(z));
  }
  for (int h = 0; h < g; ++h) {
    float* p = sc + h * ss;
    vf acc = splat(0.0f);
    for (int64_t t = 0; t < nv; t += W) {
      const vf pt = loadu(p + t);
      acc += pt * loadu(vz + t);
      storeu(p + t, pt * loadu(vs + t));
    }
    zsum[h] = hsum(acc);
  }
}

// Prefetch the scales and zeros a span of slots [j0, j0 + n) of (page, head) ph needs (two
// tiles ahead, with the first line of its code runs; see touch_runs). Measured per slot and KV
// head (one thread, 242 MB of pages evicted from L3 before each run, variants alternating in
// one process): 25 ns; 31 with the demand loads the int8 / fp8 scales take; 27 when every
// line of the code runs is prefetched too; 37 without touching the scales.
static inline void touch_int4_scales(const DecodeArgs& a, int64_t ph, int64_t j0, int64_t n) {
  const int64_t d = a.head_dim, bs = a.block_size;
  for (int64_t o = 0; o < d; o += 32) {  // 32 fp16 per line
    __builtin_prefetch(a.key_scale + ph * d + o, 0, 3);
    __builtin_prefetch(a.key_zero + ph * d + o, 0, 3);
  }
  const int64_t v0 = ph * bs + j0, v1 = v0 + n - 1;
  __builtin_prefetch(a.value_scale + v0, 0, 3);
  __builtin_prefetch(a.value_scale + v1, 0, 3);
  __builtin_prefetch(a.value_zero + v0, 0, 3);
  __builtin_prefetch(a.value_zero + v1, 0, 3);
}
