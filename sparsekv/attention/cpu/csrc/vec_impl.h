// Vector helpers of the kernels (GCC vector extensions, W fp32 lanes): loads, bf16 unpacking,
// exp2, transposing lane sums. Part of kernel_impl.h; see there.
//
// Element order. A chunk of 2W head_dim elements is loaded as two W-lane fp32 vectors. For bf16
// the 2W values are read as W 32-bit words: `word << 16` gives the even elements and
// `word & 0xffff0000` the odd ones (one instruction per vector instead of a widening convert),
// so q and the output accumulators are kept in that permuted order (chunk_pos) and un-permuted
// when written. fp32 chunks keep their natural order. The AMX unit (SKV_AMX) keeps its bf16
// accumulators in the order its value tiles produce instead (see decode_amx.h).

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
  const int64_t base = e - e % (2 * W), r = e % (2 * W);
#if SKV_AMX
  // unpacklo/hi_epi16 work per 128-bit lane: element r of a 32-element chunk sits in the lo
  // tile (first 16 columns) if r % 8 < 4, else in the hi tile, at column 4 * (r / 8) + r % 4.
  return base + ((r & 4) ? 16 : 0) + 4 * (r >> 3) + (r & 3);
#else
  return base + ((r & 1) ? W + (r >> 1) : (r >> 1));
#endif
}

static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
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
// -126 (so masked -inf logits give 0), clamped at 2^127 above.
static inline vf vexp2(vf x) {
  const vi under = x < splat(-126.0f);
  x = x > splat(127.0f) ? splat(127.0f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x + magic) - magic;
  const vf f = x - n;
  vf p = splat(1.5403530393381606e-4f);
  p = p * f + splat(1.3333558146428443e-3f);
  p = p * f + splat(9.6181291076284772e-3f);
  p = p * f + splat(5.5504108664821580e-2f);
  p = p * f + splat(2.4022650695910071e-1f);
  p = p * f + splat(6.9314718055994531e-1f);
  p = p * f + splat(1.0f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return under ? splat(0.0f) : p * (vf)e;
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
