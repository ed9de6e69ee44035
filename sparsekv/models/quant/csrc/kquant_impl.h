// Code decoders of the GGUF formats whose codes are not one nibble or byte per value of a block
// of 32 (included by quant_impl.h; byte layouts in quant.h): Q5_0 (a fifth bit per code from a
// 32-bit word), Q4_K and Q6_K (super-blocks of 256 values with per-sub-block scales). Each
// returns codes as exact small integers in fp32 vectors of 8 consecutive values, widened with
// integer vector operations (one widening load, a shift and a mask, one convert per 8 values):
// the caller applies the scales, so dequantized values round once as in gguf-py
// (`gguf.quants.dequantize`).

typedef int32_t vi __attribute__((vector_size(32)));

// Bytes p[0, 8) zero-extended into 8 lanes.
static inline vu widen_u8(const uint8_t* p) {
#ifdef QK_AVX2
  return (vu)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#else
  uint32_t v[kLanes];
  for (int i = 0; i < kLanes; ++i) v[i] = p[i];
  vu out;
  __builtin_memcpy(&out, v, sizeof(out));
  return out;
#endif
}

static inline vf codes_to_float(vu codes) { return __builtin_convertvector((vi)codes, vf); }
static inline vu splat_u(uint32_t x) { return x + vu{}; }

// Q5_0 block (fp16 d, 32-bit qh, 16 bytes qs): value j's code is nibble j of qs (low nibbles of
// bytes 0-15, then their high nibbles) plus bit j of qh times 16; w = d * (code - 16). out[i]
// holds code - 16 of values 8i .. 8i + 7.
static inline void q5_0_codes(const uint8_t* blk, vf out[4]) {
  uint32_t qh;
  __builtin_memcpy(&qh, blk + 2, 4);
  const vu lane = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int i = 0; i < 4; ++i) {
    const vu bytes = widen_u8(blk + 6 + 8 * (i & 1));
    const vu low = i < 2 ? bytes & 15u : bytes >> 4;
    const vu high = ((splat_u(qh) >> (lane + static_cast<uint32_t>(8 * i))) & 1u) << 4;
    out[i] = codes_to_float(low | high) - splat(16.0f);
  }
}

// Q4_K super-block (fp16 d, fp16 dmin, 12 bytes of scales, 128 bytes qs): 8 sub-blocks of 32
// with 6-bit scale sc[j] and min mn[j]; w = d * sc[j] * code - dmin * mn[j]. The 12 bytes hold
// sc[0..3] and mn[0..3] in the low 6 bits of bytes 0-3 and 4-7; sc[4..7] and mn[4..7] have
// their low 4 bits in the low and high nibbles of bytes 8-11 and their top 2 bits in the top 2
// bits of bytes 0-3 and 4-7.
static inline void q4_k_scales(const uint8_t* s, float d, float dmin, float scale[8],
                               float offset[8]) {
  for (int j = 0; j < 4; ++j) {
    scale[j] = d * static_cast<float>(s[j] & 63);
    offset[j] = dmin * static_cast<float>(s[j + 4] & 63);
    scale[j + 4] = d * static_cast<float>((s[j + 8] & 15) | ((s[j] >> 6) << 4));
    offset[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

// Codes of Q4_K sub-block j: the low (j even) or high (j odd) nibbles of qs bytes
// 32 * (j / 2) .. + 31, in order.
static inline void q4_k_codes(const uint8_t* blk, int j, vf out[4]) {
  const uint8_t* q = blk + 16 + 32 * (j / 2);
  for (int i = 0; i < 4; ++i) {
    const vu bytes = widen_u8(q + 8 * i);
    out[i] = codes_to_float(j % 2 ? bytes >> 4 : bytes & 15u);
  }
}

// Q6_K super-block (128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d): 16 sub-blocks of 16
// with scale d * scales[s]; w = d * scales[s] * (code - 32), a 6-bit code. Each half h of 128
// values takes ql bytes 64h .. + 63 (their low nibbles are values 0-63, high nibbles 64-127)
// and qh bytes 32h .. + 31 (bits 2t, 2t + 1 of byte i are the top bits of value 32t + i).
// out[0], out[1]: code - 32 of sub-block s's values 0-7 and 8-15.
static inline void q6_k_codes(const uint8_t* blk, int s, vf out[2]) {
  const int h = s / 8;
  for (int t = 0; t < 2; ++t) {
    const int g = 2 * (s % 8) + t;  // group of 8 values within the half
    const vu lo = widen_u8(blk + 64 * h + 8 * g % 64);
    const vu hi = widen_u8(blk + 128 + 32 * h + 8 * g % 32);
    const vu low4 = g < 8 ? lo & 15u : lo >> 4;
    const vu high2 = (hi >> static_cast<uint32_t>(2 * (g / 4))) & 3u;
    out[t] = codes_to_float(low4 | (high2 << 4)) - splat(32.0f);
  }
}
