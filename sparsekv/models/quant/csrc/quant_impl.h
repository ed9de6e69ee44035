// Packed-weight kernels with 8-lane fp32 vectors (GCC vector extensions); included by each
// isa_*.cpp inside its own namespace (see quant.h). The AVX2 variant compiles these loops to
// 256-bit instructions with fused multiply-adds; the generic one to pairs of baseline 128-bit
// instructions.
//
// Dequantized values equal gguf-py's (`gguf.quants.dequantize`) bit for bit: d * q is exact in
// fp32 (an fp16 scale times a code of at most 8 bits), so `d * q + m` rounds once either way.
// Dot products accumulate in fp32 in their own order (blocks of 32, 8 lanes, then the lanes),
// so they differ from a sequential fp32 sum by rounding only.

typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));

constexpr int kLanes = 8;

static inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
#ifdef QK_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    float value = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    __builtin_memcpy(&bits, &value, 4);
    bits |= sign;
  } else if (exponent == 31) {  // inf / NaN
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float out;
  __builtin_memcpy(&out, &bits, 4);
  return out;
#endif
}

static inline vf splat(float x) { return x - vf{}; }
static inline vf loadf(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
static inline void storef(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(v)); }
#ifdef QK_AVX2
// Widening conversions as single instructions (vpmovzxbd / vpmovsxbd / vpmovzxwd): GCC lowers
// __builtin_convertvector on 8-byte vectors to per-element inserts.
static inline vf from_u8(const uint8_t* p) {
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf from_s8(const uint8_t* p) {
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf from_bf16(const uint8_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return (vf)_mm256_slli_epi32(wide, 16);
}
#else
// Plain loops the compiler vectorizes with the baseline ISA's unpack instructions.
static inline vf from_u8(const uint8_t* p) {
  float v[kLanes];
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return loadf(v);
}
static inline vf from_s8(const uint8_t* p) {
  float v[kLanes];
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(static_cast<int8_t>(p[i]));
  return loadf(v);
}
static inline vf from_bf16(const uint8_t* p) {
  uint32_t v[kLanes];
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<uint32_t>(p[2 * i] | (p[2 * i + 1] << 8)) << 16;
  vf out;
  __builtin_memcpy(&out, v, sizeof(out));
  return out;
}
#endif
static inline float hsum(vf v) {
  float lo[4] = {v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]};
  return (lo[0] + lo[2]) + (lo[1] + lo[3]);
}

// The 32 codes of a 4-bit block as fp32 vectors of elements 0-7, 8-15, 16-23, 24-31.
static inline void nibbles(const uint8_t* qs, vf out[4]) {
#ifdef QK_AVX2
  const __m128i q = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
  out[0] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#else
  uint8_t codes[32];
  for (int j = 0; j < 16; ++j) {
    codes[j] = qs[j] & 0xf;
    codes[j + 16] = qs[j] >> 4;
  }
  for (int i = 0; i < 4; ++i) out[i] = from_u8(codes + 8 * i);
#endif
}

#include "kquant_impl.h"

// Bytes of one block of 32 values of each block format (of 256 values: the k-quants).
template <int F>
constexpr int64_t block_bytes() {
  return F == kQ4_0   ? 18
         : F == kQ4_1 ? 20
         : F == kQ5_0 ? 22
         : F == kQ4_K ? 144
         : F == kQ6_K ? 210
                      : 34;
}
constexpr int64_t kSuperBlock = 256;  // values of a k-quant super-block

// sum_j W[row, j] x[j] over the whole row (fp32 accumulation).
template <int F>
static float row_dot(const uint8_t* row, const float* x, const float* sums, int64_t k) {
  vf acc = {};
  if constexpr (F == kQ4_0 || F == kQ4_1) {
    float offsets = 0.0f;  // sum over blocks of c * sum(x): c = m (Q4_1) or -8 d (Q4_0)
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const uint8_t* blk = row + b * block_bytes<F>();
      const float d = half_to_float(blk);
      vf q[4];
      nibbles(blk + (F == kQ4_1 ? 4 : 2), q);
      const float* xb = x + b * kBlock;
      vf dot = q[0] * loadf(xb);
      dot += q[1] * loadf(xb + 8);
      dot += q[2] * loadf(xb + 16);
      dot += q[3] * loadf(xb + 24);
      acc += splat(d) * dot;
      offsets += (F == kQ4_1 ? half_to_float(blk + 2) : -8.0f * d) * sums[b];
    }
    return hsum(acc) + offsets;
  } else if constexpr (F == kQ4_K) {
    float offsets = 0.0f;  // sum over sub-blocks of dmin * mn[j] * sum(x)
    for (int64_t b = 0; b < k / kSuperBlock; ++b) {
      const uint8_t* blk = row + b * block_bytes<F>();
      float scale[8], offset[8];
      q4_k_scales(blk + 4, half_to_float(blk), half_to_float(blk + 2), scale, offset);
      for (int j = 0; j < 8; ++j) {
        vf q[4];
        q4_k_codes(blk, j, q);
        const float* xb = x + b * kSuperBlock + j * kBlock;
        vf dot = q[0] * loadf(xb);
        dot += q[1] * loadf(xb + 8);
        dot += q[2] * loadf(xb + 16);
        dot += q[3] * loadf(xb + 24);
        acc += splat(scale[j]) * dot;
        offsets += offset[j] * sums[b * 8 + j];
      }
    }
    return hsum(acc) - offsets;
  } else if constexpr (F == kQ6_K) {
    for (int64_t b = 0; b < k / kSuperBlock; ++b) {
      const uint8_t* blk = row + b * block_bytes<F>();
      const float d = half_to_float(blk + 208);
      for (int s = 0; s < 16; ++s) {
        vf q[2];
        q6_k_codes(blk, s, q);
        const float* xb = x + b * kSuperBlock + s * 16;
        const vf dot = q[0] * loadf(xb) + q[1] * loadf(xb + 8);
        acc += splat(d * static_cast<float>(static_cast<int8_t>(blk[192 + s]))) * dot;
      }
    }
    return hsum(acc);
  } else if constexpr (F == kQ5_0) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const uint8_t* blk = row + b * block_bytes<F>();
      const float* xb = x + b * kBlock;
      vf q[4];
      q5_0_codes(blk, q);
      vf dot = q[0] * loadf(xb);
      dot += q[1] * loadf(xb + 8);
      dot += q[2] * loadf(xb + 16);
      dot += q[3] * loadf(xb + 24);
      acc += splat(half_to_float(blk)) * dot;
    }
    return hsum(acc);
  } else if constexpr (F == kQ8_0) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const uint8_t* blk = row + b * block_bytes<F>();
      const float* xb = x + b * kBlock;
      vf dot = from_s8(blk + 2) * loadf(xb);
      dot += from_s8(blk + 10) * loadf(xb + 8);
      dot += from_s8(blk + 18) * loadf(xb + 16);
      dot += from_s8(blk + 26) * loadf(xb + 24);
      acc += splat(half_to_float(blk)) * dot;
    }
    return hsum(acc);
  } else {
    const uint8_t* codes = F == kInt8Row ? row + 4 : row;
    const int64_t full = k / kLanes * kLanes;
    float tail = 0.0f;
    if constexpr (F == kInt8Row) {
      for (int64_t j = 0; j < full; j += kLanes) acc += from_s8(codes + j) * loadf(x + j);
      for (int64_t j = full; j < k; ++j) tail += static_cast<float>(static_cast<int8_t>(codes[j])) * x[j];
      float scale;
      __builtin_memcpy(&scale, row, 4);
      return scale * (hsum(acc) + tail);
    } else {
      for (int64_t j = 0; j < full; j += kLanes) acc += from_bf16(codes + 2 * j) * loadf(x + j);
      for (int64_t j = full; j < k; ++j) {
        uint32_t bits = static_cast<uint32_t>(codes[2 * j] | (codes[2 * j + 1] << 8)) << 16;
        float w;
        __builtin_memcpy(&w, &bits, 4);
        tail += w * x[j];
      }
      return hsum(acc) + tail;
    }
  }
}

// out[0, len) <- W[row, j0 + i] dequantized; for the block formats j0 and len are multiples
// of 32 (of 256 for the k-quants).
template <int F>
static void dequant_range(const uint8_t* row, int64_t j0, int64_t len, float* out) {
  if constexpr (F == kQ4_K) {
    for (int64_t b = j0 / kSuperBlock; b < (j0 + len) / kSuperBlock; ++b) {
      const uint8_t* blk = row + b * block_bytes<F>();
      float scale[8], offset[8];
      q4_k_scales(blk + 4, half_to_float(blk), half_to_float(blk + 2), scale, offset);
      for (int j = 0; j < 8; ++j, out += kBlock) {
        vf q[4];
        q4_k_codes(blk, j, q);
        for (int i = 0; i < 4; ++i) storef(out + 8 * i, splat(scale[j]) * q[i] - splat(offset[j]));
      }
    }
  } else if constexpr (F == kQ6_K) {
    for (int64_t b = j0 / kSuperBlock; b < (j0 + len) / kSuperBlock; ++b) {
      const uint8_t* blk = row + b * block_bytes<F>();
      const float d = half_to_float(blk + 208);
      for (int s = 0; s < 16; ++s, out += 16) {
        vf q[2];
        q6_k_codes(blk, s, q);
        const vf scale = splat(d * static_cast<float>(static_cast<int8_t>(blk[192 + s])));
        storef(out, scale * q[0]);
        storef(out + 8, scale * q[1]);
      }
    }
  } else if constexpr (F == kQ5_0) {
    for (int64_t b = j0 / kBlock; b < (j0 + len) / kBlock; ++b, out += kBlock) {
      const uint8_t* blk = row + b * block_bytes<F>();
      const vf scale = splat(half_to_float(blk));
      vf q[4];
      q5_0_codes(blk, q);
      for (int i = 0; i < 4; ++i) storef(out + 8 * i, scale * q[i]);
    }
  } else if constexpr (F == kQ4_0 || F == kQ4_1) {
    for (int64_t b = j0 / kBlock; b < (j0 + len) / kBlock; ++b, out += kBlock) {
      const uint8_t* blk = row + b * block_bytes<F>();
      const float d = half_to_float(blk);
      const vf scale = splat(d), offset = splat(F == kQ4_1 ? half_to_float(blk + 2) : -8.0f * d);
      vf q[4];
      nibbles(blk + (F == kQ4_1 ? 4 : 2), q);
      for (int i = 0; i < 4; ++i) storef(out + 8 * i, scale * q[i] + offset);
    }
  } else if constexpr (F == kQ8_0) {
    for (int64_t b = j0 / kBlock; b < (j0 + len) / kBlock; ++b, out += kBlock) {
      const uint8_t* blk = row + b * block_bytes<F>();
      const vf scale = splat(half_to_float(blk));
      for (int i = 0; i < 4; ++i) storef(out + 8 * i, scale * from_s8(blk + 2 + 8 * i));
    }
  } else if constexpr (F == kInt8Row) {
    float s;
    __builtin_memcpy(&s, row, 4);
    const uint8_t* codes = row + 4 + j0;
    const int64_t full = len / kLanes * kLanes;
    for (int64_t j = 0; j < full; j += kLanes) storef(out + j, splat(s) * from_s8(codes + j));
    for (int64_t j = full; j < len; ++j) out[j] = s * static_cast<float>(static_cast<int8_t>(codes[j]));
  } else {
    const uint8_t* codes = row + 2 * j0;
    for (int64_t j = 0; j < len; ++j) {
      uint32_t bits = static_cast<uint32_t>(codes[2 * j] | (codes[2 * j + 1] << 8)) << 16;
      __builtin_memcpy(out + j, &bits, 4);
    }
  }
}

template <int F>
static void gemv_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i)
    a.y[a.col + i] = row_dot<F>(a.w + i * a.row_bytes, a.x, a.x_block_sums, a.k);
}

constexpr int kTileRows = 4;   // weight rows dequantized together
constexpr int64_t kChunk = 256;  // input features per dequantized tile (4 KiB of fp32)

// y[r, cols] (+)= x rows r, r + 1 (or r alone) times the dequantized tile, over `len` features.
static inline void tile_dot(const float (*tile)[kChunk], int64_t len, const float* x0,
                            const float* x1, float* y0, float* y1, int nr, bool add) {
  vf c0[kTileRows] = {}, c1[kTileRows] = {};
  const int64_t full = len / kLanes * kLanes;
  for (int64_t j = 0; j < full; j += kLanes) {
    const vf xa = loadf(x0 + j), xb = x1 ? loadf(x1 + j) : vf{};
    for (int i = 0; i < kTileRows; ++i) {
      const vf w = loadf(tile[i] + j);
      c0[i] += w * xa;
      c1[i] += w * xb;
    }
  }
  for (int i = 0; i < nr; ++i) {
    float s0 = hsum(c0[i]), s1 = hsum(c1[i]);
    for (int64_t j = full; j < len; ++j) {
      s0 += tile[i][j] * x0[j];
      if (x1) s1 += tile[i][j] * x1[j];
    }
    y0[i] = add ? y0[i] + s0 : s0;
    if (x1) y1[i] = add ? y1[i] + s1 : s1;
  }
}

template <int F>
static void gemm_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  alignas(32) float tile[kTileRows][kChunk];
  for (int64_t i0 = begin; i0 < end; i0 += kTileRows) {
    const int nr = static_cast<int>(end - i0 < kTileRows ? end - i0 : kTileRows);
    for (int64_t j0 = 0; j0 < a.k; j0 += kChunk) {
      const int64_t len = a.k - j0 < kChunk ? a.k - j0 : kChunk;
      for (int i = 0; i < kTileRows; ++i) {
        if (i < nr) {
          dequant_range<F>(a.w + (i0 + i) * a.row_bytes, j0, len, tile[i]);
        } else {
          for (int64_t j = 0; j < len; ++j) tile[i][j] = 0.0f;
        }
      }
      for (int64_t r = 0; r < a.m; r += 2) {
        const float* x0 = a.x + r * a.x_stride + j0;
        const float* x1 = r + 1 < a.m ? x0 + a.x_stride : nullptr;
        float* y0 = a.y + r * a.y_stride + a.col + i0;
        tile_dot(tile, len, x0, x1, y0, y0 + a.y_stride, nr, j0 > 0);
      }
    }
  }
}

template <int F>
static void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t k, float* out,
                         int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) dequant_range<F>(w + i * row_bytes, 0, k, out + i * k);
}

#define QK_DISPATCH(fn, format, ...)                  \
  switch (format) {                                   \
    case kQ4_0: return fn<kQ4_0>(__VA_ARGS__);        \
    case kQ4_1: return fn<kQ4_1>(__VA_ARGS__);        \
    case kQ8_0: return fn<kQ8_0>(__VA_ARGS__);        \
    case kInt8Row: return fn<kInt8Row>(__VA_ARGS__);  \
    case kQ4_K: return fn<kQ4_K>(__VA_ARGS__);        \
    case kQ6_K: return fn<kQ6_K>(__VA_ARGS__);        \
    case kQ5_0: return fn<kQ5_0>(__VA_ARGS__);        \
    default: return fn<kBf16Row>(__VA_ARGS__);        \
  }

static void gemv(const MatmulArgs& a, int64_t begin, int64_t end) {
  QK_DISPATCH(gemv_rows, a.format, a, begin, end)
}
static void gemm(const MatmulArgs& a, int64_t begin, int64_t end) {
  QK_DISPATCH(gemm_rows, a.format, a, begin, end)
}
static void dequantize(const uint8_t* w, int64_t row_bytes, int format, int64_t k, float* out,
                       int64_t begin, int64_t end) {
  QK_DISPATCH(dequant_rows, format, w, row_bytes, k, out, begin, end)
}
#undef QK_DISPATCH
