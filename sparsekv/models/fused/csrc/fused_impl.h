// Row kernels of the fused ops with FK_W fp32 lanes (GCC vector extensions); included by each
// isa_*.cpp inside its own namespace (see fused.h).
//
// Rounding follows PyTorch's own CPU kernels operation for operation. They are built with FMA
// contraction for their AVX2 / AVX-512 variants, so eager `a + b * c` is one fused multiply-add
// there (rotary's addcmul, GELU's inner polynomial); this file is built without contraction
// (-ffp-contract=off) and uses fmadd() exactly where those kernels fuse, so the rotary and
// residual results are bit-identical to eager. The baseline (generic) variant, like PyTorch's
// baseline kernels, rounds the product separately.
//
// A row's last partial vector goes through a zero-padded W-element buffer, so every element
// takes the same vector code path (and zero padding adds nothing to a sum of squares).

typedef float vf __attribute__((vector_size(FK_W * 4)));
typedef int32_t vi __attribute__((vector_size(FK_W * 4)));
typedef uint32_t vu __attribute__((vector_size(FK_W * 4)));
typedef uint16_t vh __attribute__((vector_size(FK_W * 2)));

constexpr int W = FK_W;

static inline vf splat(float x) {  // x - 0 (not 0 + x, which is not x for -0) folds to a broadcast
  return x - vf{};
}

// a * b + c, one rounding where the variant has FMA (see the top of the file).
#if FK_W == 16
static inline vf fmadd(vf a, vf b, vf c) {
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#elif FK_W == 8
static inline vf fmadd(vf a, vf b, vf c) {
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
static inline vf fmadd(vf a, vf b, vf c) { return a * b + c; }
#endif

static inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
static inline vf load(const uint16_t* p) {  // bf16 bit patterns -> fp32 (exact)
#if FK_W == 16
  // One widening load (vpmovzxwd); GCC splits the generic form into two halves.
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return (vf)_mm512_slli_epi32(wide, 16);
#else
  vh h;
  __builtin_memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}
// Round to nearest even bf16 as torch does (NaN -> 0x7fc0); the result in the upper 16 bits.
static inline vu bf16_bits(vf v) {
  const vu u = (vu)v;
  const vu rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return (u & 0x7fffffffu) > 0x7f800000u ? (vu){} + 0x7fc00000u : rounded;
}
static inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(v)); }
static inline void store(uint16_t* p, vf v) {
#if FK_W == 16
  // One narrowing store (vpmovdw) instead of GCC's word permute of the generic form.
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16((__m512i)(bf16_bits(v) >> 16)));
#else
  const vh h = __builtin_convertvector(bf16_bits(v) >> 16, vh);
  __builtin_memcpy(p, &h, sizeof(h));
#endif
}
// Stores v, whose values are already of the element type (round_to's results): for bf16 the
// upper halves as they are, without store's second rounding.
static inline void store_exact(float* p, vf v) { store(p, v); }
static inline void store_exact(uint16_t* p, vf v) {
#if FK_W == 16
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16((__m512i)((vu)v >> 16)));
#else
  const vh h = __builtin_convertvector((vu)v >> 16, vh);
  __builtin_memcpy(p, &h, sizeof(h));
#endif
}
// v rounded to the element type T (the value an eager op in dtype T would hold).
static inline vf round_to(const float*, vf v) { return v; }
static inline vf round_to(const uint16_t*, vf v) { return (vf)(bf16_bits(v) & 0xffff0000u); }

// The first `count` (<= W) elements; fewer than W go through a zero-padded buffer.
template <typename T>
static inline vf load_n(const T* p, int64_t count) {
  if (count == W) return load(p);
  T buf[W] = {};
  __builtin_memcpy(buf, p, count * sizeof(T));
  return load(buf);
}
template <typename T>
static inline void store_n(T* p, vf v, int64_t count) {
  if (count == W) return store(p, v);
  T buf[W];
  store(buf, v);
  __builtin_memcpy(p, buf, count * sizeof(T));
}
template <typename T>
static inline void store_exact_n(T* p, vf v, int64_t count) {
  if (count == W) return store_exact(p, v);
  T buf[W];
  store_exact(buf, v);
  __builtin_memcpy(p, buf, count * sizeof(T));
}

static inline float hsum(vf v) {
  float s[W];
  __builtin_memcpy(s, &v, sizeof(v));
  for (int n = W / 2; n > 0; n /= 2)
    for (int i = 0; i < n; ++i) s[i] += s[i + n];
  return s[0];
}

static inline int64_t row_offset(const RowLayout& layout, int64_t r) {
  return (r / layout.inner) * layout.stride_outer + (r % layout.inner) * layout.stride_inner;
}

// e^x to ~1 ulp (Cephes expf: e^x = 2^n e^r with n = round(x / ln 2), r = x - n ln 2 in two
// steps, degree-5 polynomial of e^r), +inf above ln(FLT_MAX), NaN kept.
constexpr float kLog2e = 1.44269504088896341f;
#if FK_W == 16
// AVX-512: one instruction each to clamp, round and scale by 2^n (vscalefps overflows to inf and
// underflows gradually, as IEEE arithmetic would); the clamp only keeps r finite.
static inline vf vexp(vf x) {
  x = (vf)_mm512_max_ps(_mm512_min_ps((__m512)x, (__m512)splat(88.8f)), (__m512)splat(-104.0f));
  const vf n = (vf)_mm512_roundscale_ps((__m512)(x * splat(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
// Below ln(FLT_MIN) the result is 0 instead of subnormal (only ever added to 1 here).
static inline vf vexp(vf x) {
  const vi over = x > splat(88.72283935546875f);
  const vi under = x < splat(-87.33654475f);
  x = x < splat(-87.33654475f) ? splat(-87.33654475f) : x;
  x = x > splat(88.72283935546875f) ? splat(88.72283935546875f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * splat(kLog2e) + magic) - magic;
#endif
  vf r = fmadd(n, splat(-0.693359375f), x);
  r = fmadd(n, splat(2.12194440e-4f), r);
  vf p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  const vf y = fmadd(p, r * r, r) + splat(1.0f);
#if FK_W == 16
  return (vf)_mm512_scalef_ps((__m512)y, (__m512)n);
#else
  // 2^n in two factors: n reaches 128 at the top of the range, past fp32's largest exponent.
  const vi ni = __builtin_convertvector(n, vi);
  const vi half = ni >> 1;
  const vf scaled = y * (vf)((half + 127) << 23) * (vf)((ni - half + 127) << 23);
  return under ? splat(0.0f) : over ? splat(__builtin_inff()) : scaled;
#endif
}

// tanh as 1 - 2 / (e^{2|y|} + 1) with y's sign; exactly +-1 beyond 8.664339742, as the Sleef
// tanhf PyTorch uses (so 1 + tanh cancels exactly as in eager GELU).
static inline vf vtanh(vf y) {
  const vf a = (vf)((vu)y & 0x7fffffffu);
  const vf capped = a > splat(9.0f) ? splat(9.0f) : a;
  vf t = splat(1.0f) - splat(2.0f) / (vexp(capped + capped) + splat(1.0f));
  t = a > splat(8.664339742f) ? splat(1.0f) : t;
  return (vf)((vu)t | ((vu)y & 0x80000000u));
}

// PyTorch's SiLU: x / (1 + e^-x) in fp32. (A reciprocal-and-correction form without vdivps
// measured slower: the kernel is bound by its instruction count, not the divider.)
static inline vf silu(vf x) { return x / (splat(1.0f) + vexp(-x)); }

// PyTorch's tanh GELU, operation for operation:
// 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))).
static inline vf gelu_tanh(vf x) {
  const float beta = (float)(1.41421356237309504880 * 1.12837916709551257390 * 0.5);
  const vf cube = x * x * x;
  const vf inner = splat(beta) * fmadd(splat((float)0.044715), cube, x);
  return splat(0.5f) * x * (splat(1.0f) + vtanh(inner));
}

// Elements [i, i + count) of the row to normalise: x, or x + delta rounded to T (then also
// written to `sum`).
template <typename T>
static inline vf norm_input(const T* x, const T* delta, T* sum, int64_t i, int64_t count) {
  const vf s = load_n(x + i, count);
  if (delta == nullptr) return s;
  const vf rounded = round_to(sum, s + load_n(delta + i, count));
  store_exact_n(sum + i, rounded, count);
  return rounded;
}

template <typename T>
static void norm_rows(const NormArgs& a, int64_t begin, int64_t end) {
  const int64_t n = a.n;
  for (int64_t r = begin; r < end; ++r) {
    const T* x = static_cast<const T*>(a.x) + row_offset(a.x_rows, r);
    const T* delta = nullptr;
    T* sum = nullptr;
    if (a.delta != nullptr) {
      delta = static_cast<const T*>(a.delta) + row_offset(a.delta_rows, r);
      sum = static_cast<T*>(a.sum_out) + r * n;
    }
    vf acc[4] = {};  // four partial sums: shorter dependency chains, smaller rounding error
    int64_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W)
      for (int k = 0; k < 4; ++k) {
        const vf s = norm_input(x, delta, sum, i + k * W, W);
        acc[k] += s * s;
      }
    for (; i < n; i += W) {
      const vf s = norm_input(x, delta, sum, i, n - i < W ? n - i : W);
      acc[0] += s * s;
    }
    const float mean = hsum((acc[0] + acc[1]) + (acc[2] + acc[3])) / (float)n;
    const vf inv = splat(1.0f / __builtin_sqrtf(mean + a.eps));
    const T* src = sum != nullptr ? sum : x;
    T* out = static_cast<T*>(a.out) + r * n;
    for (i = 0; i < n; i += W) {
      const int64_t count = n - i < W ? n - i : W;
      store_n(out + i, load_n(src + i, count) * inv * load_n(a.weight + i, count), count);
    }
  }
}

template <typename T, vf (*Act)(vf)>
static void glu_rows(const GluArgs& a, int64_t begin, int64_t end) {
  const int64_t n = a.n;
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(a.x) + r * a.x_stride;
    const T* up = gate + n;
    T* out = static_cast<T*>(a.out) + r * n;
    for (int64_t i = 0; i < n; i += W) {
      const int64_t count = n - i < W ? n - i : W;
      const vf act = round_to(out, Act(load_n(gate + i, count)));
      store_n(out + i, act * load_n(up + i, count), count);
    }
  }
}

// Rotate-half on `count` (<= W) elements at offset i of each half of one head.
template <typename T>
static inline void rotate_step(T* x, const T* c, const T* s, int64_t half, int64_t i,
                               int64_t count) {
  const vf x1 = load_n(x + i, count), x2 = load_n(x + half + i, count);
  const vf c1 = load_n(c + i, count), c2 = load_n(c + half + i, count);
  const vf s1 = load_n(s + i, count), s2 = load_n(s + half + i, count);
  const vf o1 = fmadd(x2, s1, round_to(x, x1 * c1));  // x * cos + cat(x2, x1) * signed_sin
  const vf o2 = fmadd(x1, s2, round_to(x, x2 * c2));
  store_n(x + i, o1, count);
  store_n(x + half + i, o2, count);
}

template <typename T>
static void rotary_rows(const RotaryArgs& a, int64_t begin, int64_t end) {
  const int64_t half = a.head_dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const T* c = static_cast<const T*>(a.cos) + t * a.table_stride;
    const T* s = static_cast<const T*>(a.sin) + t * a.table_stride;
    for (int64_t h = 0; h < a.heads; ++h) {
      T* x = static_cast<T*>(a.x) + t * a.token_stride + h * a.head_stride;
      for (int64_t i = 0; i < half; i += W)
        rotate_step(x, c, s, half, i, half - i < W ? half - i : W);
    }
  }
}

#if FK_W == 16
// glu_rows for bf16 with the activation from a.lut (see GluArgs): a 32-bit gather of
// lut[gate bits] replaces exp and the rounding of the activation. The table (128 KiB) stays in
// L2, and the values of a real activation tensor hit few of its lines.
static inline vf lut_act(const uint16_t* lut, const uint16_t* gate) {
  const __m512i index = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)gate));
  const __m512i bits = _mm512_i32gather_epi32(index, (const void*)lut, 2);  // low half: entry
  return (vf)_mm512_slli_epi32(bits, 16);
}

static void glu_rows_lut(const GluArgs& a, int64_t begin, int64_t end) {
  const int64_t n = a.n;
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* gate = static_cast<const uint16_t*>(a.x) + r * a.x_stride;
    const uint16_t* up = gate + n;
    uint16_t* out = static_cast<uint16_t*>(a.out) + r * n;
    int64_t i = 0;
    for (; i + W <= n; i += W) store(out + i, lut_act(a.lut, gate + i) * load(up + i));
    if (i < n) {
      uint16_t tail[W] = {};  // gate 0 -> act(0), multiplied by up's zero padding
      __builtin_memcpy(tail, gate + i, (n - i) * sizeof(uint16_t));
      store_n(out + i, lut_act(a.lut, tail) * load_n(up + i, n - i), n - i);
    }
  }
}
#endif

template <typename T, vf (*Act)(vf)>
static void glu(const GluArgs& a, int64_t begin, int64_t end) {
#if FK_W == 16
  if (sizeof(T) == 2 && a.lut != nullptr) return glu_rows_lut(a, begin, end);
#endif
  glu_rows<T, Act>(a, begin, end);
}

static void rms_norm(const NormArgs& a, int64_t begin, int64_t end) {
  a.bf16 ? norm_rows<uint16_t>(a, begin, end) : norm_rows<float>(a, begin, end);
}
static void silu_mul(const GluArgs& a, int64_t begin, int64_t end) {
  a.bf16 ? glu<uint16_t, silu>(a, begin, end) : glu<float, silu>(a, begin, end);
}
static void gelu_tanh_mul(const GluArgs& a, int64_t begin, int64_t end) {
  a.bf16 ? glu<uint16_t, gelu_tanh>(a, begin, end) : glu<float, gelu_tanh>(a, begin, end);
}
static void rotary(const RotaryArgs& a, int64_t begin, int64_t end) {
  a.bf16 ? rotary_rows<uint16_t>(a, begin, end) : rotary_rows<float>(a, begin, end);
}
