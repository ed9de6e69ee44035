// Vector helpers of the kernels (GCC vector extensions, W fp32 lanes): loads, bf16 unpacking,
// exp2, transposing lane sums. Part of kernel_impl.h; see there.
//
// Element order. A chunk of 2W head_dim elements is loaded as two W-lane fp32 vectors. For bf16
// the 2W values are read as W 32-bit words: `word << 16` gives the even elements and
// `word & 0xffff0000` the odd ones (one instruction per vector instead of a widening convert),
// so q and the output accumulators are kept in that permuted order (chunk_pos) and un-permuted
// when written. fp32 chunks keep their natural order; int8 / fp8 codes have their own (see
// load_chunk); int4 codes take bf16's even/odd order in every unit (int4_impl.h). The AMX unit
// (SKV_AMX) keeps its bf16 accumulators in the order its value tiles produce instead (see
// decode_amx.h).

typedef float vf __attribute__((vector_size(SKV_W * 4)));
typedef int32_t vi __attribute__((vector_size(SKV_W * 4)));
typedef uint32_t vu __attribute__((vector_size(SKV_W * 4)));

constexpr int W = SKV_W;
constexpr int kMaxGroupBlock = 8;  // query heads handled together per pass over a page
constexpr int kWinSlots = 4;       // window kernel register block: slots x row vectors
constexpr int kWinRows = 3;
constexpr float kNegInf = -__builtin_inff();

static inline vf splat(float x) {  // x - 0 (not 0 + x, which is not x for -0) folds to a broadcast
  return x - vf{};
}
static inline vf loadu(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
static inline void storeu(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(v)); }
static inline void load2(const float* p, vf& a, vf& b) {
  a = loadu(p);
  b = loadu(p + W);
}
static inline void load2(const uint16_t* p, vf& a, vf& b) {
  vu x;
  __builtin_memcpy(&x, p, sizeof(x));
  a = (vf)(x << 16);
  b = (vf)(x & 0xffff0000u);
}
// Quantized codes (int8, fp8 e4m3fn) are read as 32-bit words of 4 codes: one full-width load
// of W words holds a "quad" of 4W codes, and byte k of every word is moved to the top of its
// lane by one left shift, then brought down sign-extended by an arithmetic right shift (int8,
// then __builtin_convertvector to float) or masked into fp32 bits (fp8). (GCC 12 lowers a
// __builtin_convertvector of bytes to wider lanes to scalar code: decode ~3x slower.) A 2W
// chunk is bytes 0, 1 (even chunks) or 2, 3 (odd chunks) of its quad's words, so head_dim must
// be a multiple of 4W for these pools (kCodeQuad); see chunk_pos for the order.
struct fp8_e4m3 {  // an fp8 e4m3fn code: its bit pattern
  uint8_t bits;
};
constexpr int kCodeQuad = 4 * W;  // codes per word load

// A lane whose top byte is an int8 code -> the code as a float.
static inline vf top_byte_to_float(const int8_t*, vi t) {
  return __builtin_convertvector(t >> 24, vf);
}
// A lane whose top byte is an e4m3fn code -> fp32 of the code's value times 2^-120, without a
// table: the arithmetic shift by 4 puts exponent and mantissa at bits 20..26 (fp32's exponent
// bias is 127, e4m3's 7: hence 2^-120) and copies the sign to bits 27..31; the mask keeps bit
// 31. Subnormal codes become fp32 subnormals of the same mantissa, also exact. NaN codes (never
// written by kv_cache.quant) read as +-480.
static inline vf top_byte_to_float(const fp8_e4m3*, vi t) {
  return (vf)((vu)(t >> 4) & 0x87f00000u);
}

// Chunk c (a multiple of 2W) of a row of head_dim elements, as two W-lane vectors.
static inline void load_chunk(const float* row, int64_t c, vf& a, vf& b) { load2(row + c, a, b); }
static inline void load_chunk(const uint16_t* row, int64_t c, vf& a, vf& b) {
  load2(row + c, a, b);
}
template <typename C>
static inline void load_code_chunk(const C* row, int64_t c, vf& a, vf& b) {
  vu w;
  __builtin_memcpy(&w, row + c / kCodeQuad * kCodeQuad, sizeof(w));
  const int up = (int)(c / (2 * W) % 2) * 16;  // odd chunks: bytes 2 and 3
  a = top_byte_to_float(row, (vi)(w << (24 - up)));
  b = top_byte_to_float(row, (vi)(w << (16 - up)));
}
static inline void load_chunk(const int8_t* row, int64_t c, vf& a, vf& b) {
  load_code_chunk(row, c, a, b);
}
static inline void load_chunk(const fp8_e4m3* row, int64_t c, vf& a, vf& b) {
  load_code_chunk(row, c, a, b);
}
// Loaded values of code type T times CodeUnit<T>::value squared are the codes (fp8: 2^120).
// The kernels multiply the query, the key scales, the value coefficients and the output by
// CodeUnit (2^60 each for fp8) rather than each key or value by 2^120: no extra instruction
// per element, and products and partial sums stay far from fp32's subnormal range, where a
// query element times a code scaled by 2^-120 often falls (slow, and flushed under FTZ).
template <typename T>
struct CodeUnit {
  static constexpr float value = 1.0f;
};
template <>
struct CodeUnit<fp8_e4m3> {
  static constexpr float value = 0x1p60f;
};
// int8 and fp8 codes come with per-slot scales (kQuantized); int4 pages (int4x2: a byte of two
// codes) with per-channel key and per-slot value scales and zeros (int4_impl.h).
struct int4x2 {
  uint8_t bits;
};
template <typename T>
constexpr bool kQuantized = false;
template <>
constexpr bool kQuantized<int8_t> = true;
template <>
constexpr bool kQuantized<fp8_e4m3> = true;
template <typename T>
constexpr bool kInt4 = false;
template <>
constexpr bool kInt4<int4x2> = true;

static inline float to_float(float x) { return x; }
static inline float to_float(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline void from_float(float x, float* p) { *p = x; }
static inline void from_float(float x, uint16_t* p) {  // round to nearest even, as torch
  uint32_t u;
  __builtin_memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = (uint16_t)(u >> 16);
}

// Position of element e of a head_dim vector in the kernel's chunk order.
template <typename T>
static inline int64_t chunk_pos(int64_t e) {
  if (sizeof(T) == 4) return e;
  if (kInt4<T>) {  // even elements (low nibbles) in the first vector, odd ones in the second
    const int64_t base = e - e % (2 * W), r = e % (2 * W);
    return base + ((r & 1) ? W + (r >> 1) : (r >> 1));
  }
  if (sizeof(T) == 1) {  // codes: byte k of word i of a quad -> vector k (W lanes each), lane i
    const int64_t base = e - e % kCodeQuad, r = e % kCodeQuad;
    return base + (r % 4) * W + r / 4;
  }
  const int64_t base = e - e % (2 * W), r = e % (2 * W);
#if SKV_AMX
  // unpacklo/hi_epi16 work per 128-bit lane: element r of a 32-element chunk sits in the lo
  // tile (first 16 columns) if r % 8 < 4, else in the hi tile, at column 4 * (r / 8) + r % 4.
  return base + ((r & 4) ? 16 : 0) + 4 * (r >> 3) + (r & 3);
#else
  return base + ((r & 1) ? W + (r >> 1) : (r >> 1));
#endif
}

// Consecutive scratch parts of sizes[i] floats carved from base, each rounded up to 16 floats
// so that every part stays 64-byte aligned relative to base; parts[i] is nullptr when base is
// (sizing only). Returns the floats used.
static inline int64_t carve_scratch(float* base, const int64_t* sizes, int count, float** parts) {
  int64_t used = 0;
  for (int i = 0; i < count; ++i) {
    parts[i] = base == nullptr ? nullptr : base + used;
    used += (sizes[i] + 15) / 16 * 16;
  }
  return used;
}

static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
// min(a, b), a where it is NaN (vmax keeps b's NaN instead).
static inline vf vmin(vf a, vf b) { return b < a ? b : a; }
// Horizontal sum and max as trees of halves: log2(W) dependent steps instead of W - 1, which
// matters on the softmax's critical path (one per head per tile).
static inline float hsum(vf v) {
  float s[W];
  __builtin_memcpy(s, &v, sizeof(v));
  for (int n = W / 2; n > 0; n /= 2)
    for (int i = 0; i < n; ++i) s[i] += s[i + n];
  return s[0];
}
static inline float hmax(vf v) {
  float m[W];
  __builtin_memcpy(m, &v, sizeof(v));
  for (int n = W / 2; n > 0; n /= 2)
    for (int i = 0; i < n; ++i) m[i] = m[i + n] > m[i] ? m[i + n] : m[i];
  return m[0];
}

// 2^x to ~2e-7 relative error (degree-6 polynomial of 2^f on [-0.5, 0.5]); exactly 0 below
// -126 (so masked -inf logits give 0), clamped at 2^127 above; NaN stays NaN. Any vector type V
// of fp32 lanes with I its int32 lanes: vexp2 below runs it on vf, and the FMA window-score
// kernel on its native-width vectors (window_fused_fma.h).
template <class V, class I>
static inline V vexp2_lanes(V x) {
  const I under = x < -126.0f - V{};
  x = x > 127.0f - V{} ? 127.0f - V{} : x;
  const V magic = 12582912.0f - V{};  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (x + magic) - magic;
  const V f = x - n;
  V p = 1.5403530393381606e-4f - V{};
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const I e = (__builtin_convertvector(n, I) + 127) << 23;
  return under ? V{} : p * (V)e;
}

static inline vf vexp2(vf x) {
#if defined(SKV_AVX512) && SKV_W == 16
  // The same result bit for bit in fewer instructions: vrndscaleps rounds to the nearest
  // integer as adding and subtracting 1.5 * 2^23 does for |x| <= 127, and vscalefps multiplies
  // by 2^n exactly as the built exponent bits do (the result is a normal float for x >= -126);
  // a NaN x stays NaN (the second operand of vminps), as vexp2_lanes keeps it.
  __m512 v = (__m512)x;
  const __mmask16 seen = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  v = _mm512_min_ps(_mm512_set1_ps(127.0f), v);
  const __m512 n = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(v, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return (vf)_mm512_maskz_scalef_ps(seen, p, n);
#else
  return vexp2_lanes<vf, vi>(x);
#endif
}

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.69314718055994531f;

static inline vf vexp(vf x) { return vexp2(x * splat(kLog2e)); }

// Sum each of the W vectors v[0..W) into lane i of the result (a transposing reduction: about
// 3 shuffles/adds per vector instead of a log2(W)-step horizontal sum each).
#if SKV_W == 4
static inline vf pair_sum(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6) + __builtin_shufflevector(a, b, 1, 3, 5, 7);
}
static inline vf reduce_lanes(const vf* v) {
  return pair_sum(pair_sum(v[0], v[1]), pair_sum(v[2], v[3]));
}
#elif SKV_W == 8
static inline vf pair_sum(vf a, vf b) {  // stays within 128-bit lanes (vshufps)
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
static inline vf reduce_lanes(const vf* v) {
  const vf c0 = pair_sum(pair_sum(v[0], v[1]), pair_sum(v[2], v[3]));
  const vf c1 = pair_sum(pair_sum(v[4], v[5]), pair_sum(v[6], v[7]));
  return __builtin_shufflevector(c0, c1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(c0, c1, 4, 5, 6, 7, 12, 13, 14, 15);
}
#elif SKV_W == 16
static inline vf pair_sum(vf a, vf b) {  // stays within 128-bit lanes
  return __builtin_shufflevector(a, b, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28,
                                 30) +
         __builtin_shufflevector(a, b, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29,
                                 31);
}
static inline vf halves_sum(vf a, vf b) {  // lane groups: a01 b01 a23 b23
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26,
                                 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                 31);
}
static inline vf reduce_lanes(const vf* v) {
  vf c[4];
  for (int m = 0; m < 4; ++m) {
    const vf* u = v + 4 * m;
    c[m] = pair_sum(pair_sum(u[0], u[1]), pair_sum(u[2], u[3]));
  }
  const vf d0 = halves_sum(c[0], c[1]), d1 = halves_sum(c[2], c[3]);
  return __builtin_shufflevector(d0, d1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                                 23) +
         __builtin_shufflevector(d0, d1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                 30, 31);
}
#else
#error "SKV_W must be 4, 8 or 16"
#endif
