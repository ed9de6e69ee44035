// Paged decode attention and window scores, written once with GCC vector extensions.
//
// Included inside one namespace per ISA translation unit after `#define SKV_W <fp32 lanes>`;
// the unit's `#pragma GCC target` decides the instructions. No header is included here (see
// kernels.h for why), so only builtins are used.
//
// Element order. A chunk of 2W head_dim elements is loaded as two W-lane fp32 vectors. For bf16
// the 2W values are read as W 32-bit words: `word << 16` gives the even elements and
// `word & 0xffff0000` the odd ones (one instruction per vector instead of a widening convert),
// so q and the output accumulators are kept in that permuted order (chunk_pos) and un-permuted
// when written. fp32 chunks keep their natural order.

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
  return base + ((r & 1) ? W + (r >> 1) : (r >> 1));
}

static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
static inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}
static inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
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

// ---------------------------------------------------------------------------------------------
// Decode attention.
//
// An item walks its pages in tiles of up to kTileSlots slots (one online-softmax update per
// tile, not per page). Logits are kept in base 2 (q is pre-scaled by scale * log2(e)). While a
// tile is processed, the next tile's key rows are prefetched during the logits and its value
// rows during the value pass, so memory stays busy in both phases (block tables are not
// sequential, so the hardware prefetcher cannot find the next page).

constexpr int64_t kTileSlots = 32;
constexpr int kMaxTilePages = 8;

template <typename T>
struct PageSpan {  // slots [j0, j0 + n) of one page of one KV head
  const T* k;      // the head's key rows of the page (values follow at + kv_stride)
  int64_t j0, n;
  int64_t held;  // held index of slot j0
};

template <typename T>
static inline void prefetch_rows(const PageSpan<T>* p, int64_t offset, int64_t d, int64_t r0,
                                 int64_t r1) {
  if (p == nullptr) return;
  r1 = r1 < p->n ? r1 : p->n;
  if (r1 <= r0) return;
  const char* base = reinterpret_cast<const char*>(p->k + offset + (p->j0 + r0) * d);
  const int64_t bytes = (r1 - r0) * d * (int64_t)sizeof(T);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + o, 0, 3);
}

// Dot products of two key rows with the g query rows of q (stride d, chunk order).
template <typename T, int g>
static inline void dot2(const T* k0, const T* k1, const float* q, int64_t d, vf* a0, vf* a1) {
  for (int h = 0; h < g; ++h) a0[h] = a1[h] = splat(0.0f);
  for (int64_t c = 0; c < d; c += 2 * W) {
    vf k0e, k0o, k1e, k1o;
    load2(k0 + c, k0e, k0o);
    load2(k1 + c, k1e, k1o);
    for (int h = 0; h < g; ++h) {
      const vf qe = loadu(q + h * d + c), qo = loadu(q + h * d + c + W);
      a0[h] += qe * k0e;
      a1[h] += qe * k1e;
      a0[h] += qo * k0o;
      a1[h] += qo * k1o;
    }
  }
}

template <typename T, int g>
static inline void dot1(const T* k, const float* q, int64_t d, vf* a) {
  for (int h = 0; h < g; ++h) a[h] = splat(0.0f);
  for (int64_t c = 0; c < d; c += 2 * W) {
    vf ke, ko;
    load2(k + c, ke, ko);
    for (int h = 0; h < g; ++h) a[h] += loadu(q + h * d + c) * ke + loadu(q + h * d + c + W) * ko;
  }
}

// Logits of the span's slots for g heads into sc[h * ss + t], t < span.n (a W-slot group may
// write up to W - 1 values past n; the caller's buffer has room and overwrites them).
template <typename T, int g>
static inline void span_logits(const PageSpan<T>& sp, const PageSpan<T>* next, int64_t bs,
                               int64_t d, const float* q, float* sc, int64_t ss) {
  const T* K = sp.k;
  int64_t j = sp.j0;
  const int64_t j1 = sp.j0 + sp.n;
  for (; j < j1 && j + W <= bs; j += W) {  // W slots at once; rows past j1 are ignored
    vf part[g][W];
    for (int jj = 0; jj < W; jj += 2) {
      prefetch_rows(next, 0, d, j - sp.j0 + jj, j - sp.j0 + jj + 2);
      vf a0[g], a1[g];
      dot2<T, g>(K + (j + jj) * d, K + (j + jj + 1) * d, q, d, a0, a1);
      for (int h = 0; h < g; ++h) {
        part[h][jj] = a0[h];
        part[h][jj + 1] = a1[h];
      }
    }
    for (int h = 0; h < g; ++h) storeu(sc + h * ss + (j - sp.j0), reduce_lanes(part[h]));
  }
  for (; j < j1; ++j) {
    prefetch_rows(next, 0, d, j - sp.j0, j - sp.j0 + 1);
    vf a[g];
    dot1<T, g>(K + j * d, q, d, a);
    for (int h = 0; h < g; ++h) sc[h * ss + (j - sp.j0)] = hsum(a[h]);
  }
  prefetch_rows(next, 0, d, sp.n, bs);  // rows the next span has beyond this one's
}

// acc[h] = acc[h] * alpha[h] + sum_t p[h][t] * v[t] over chunk ci of head_dim (2W elements).
template <typename T, int g>
static inline void value_pass(const DecodeArgs& a, const PageSpan<T>* cur, int nc,
                              const PageSpan<T>* nxt, int nn, const float* sc,
                              const int64_t* offs, int64_t ss, const float* alpha, float* state,
                              int64_t ci, int64_t chunks) {
  const int64_t d = a.head_dim, st = d + 2, c = ci * 2 * W;
  const int64_t kv_stride = a.num_kv_heads * a.block_size * d;
  vf ae[g], ao[g];
  for (int h = 0; h < g; ++h) {
    ae[h] = loadu(state + h * st + 2 + c) * splat(alpha[h]);
    ao[h] = loadu(state + h * st + 2 + c + W) * splat(alpha[h]);
  }
  for (int k = 0; k < nc; ++k) {
    if (k < nn) {  // this chunk's share of the next tile's value rows
      const int64_t rows = nxt[k].n;
      prefetch_rows(nxt + k, kv_stride, d, ci * rows / chunks, (ci + 1) * rows / chunks);
    }
    const T* V = cur[k].k + kv_stride + cur[k].j0 * d + c;
    const float* p = sc + offs[k];
    for (int64_t t = 0; t < cur[k].n; ++t) {
      vf ve, vo;
      load2(V + t * d, ve, vo);
      for (int h = 0; h < g; ++h) {
        const vf pt = splat(p[h * ss + t]);
        ae[h] += pt * ve;
        ao[h] += pt * vo;
      }
    }
  }
  for (int h = 0; h < g; ++h) {
    storeu(state + h * st + 2 + c, ae[h]);
    storeu(state + h * st + 2 + c + W, ao[h]);
  }
}

// Online-softmax update of g heads with one tile. state: per head [max, sum, acc[d]] (base 2).
template <typename T, int g>
static void tile_update(const DecodeArgs& a, const PageSpan<T>* cur, int nc,
                        const PageSpan<T>* nxt, int nn, const float* q, float* sc,
                        float* state, float* scores) {
  const int64_t d = a.head_dim, bs = a.block_size, st = d + 2;
  const int64_t cap = kTileSlots > bs ? kTileSlots : bs, ss = cap + 2 * W;
  int64_t offs[kMaxTilePages + 1];
  offs[0] = 0;
  for (int k = 0; k < nc; ++k) {
    span_logits<T, g>(cur[k], k < nn ? nxt + k : nullptr, bs, d, q, sc + offs[k], ss);
    offs[k + 1] = offs[k] + cur[k].n;
  }
  const int64_t n = offs[nc], nv = (n + W - 1) / W * W;
  float alpha[g];
  for (int h = 0; h < g; ++h) {
    float* s = sc + h * ss;
    if (a.softcap > 0.0f) {  // cap * tanh(x / cap) on natural-log logits
      const float cap2 = a.softcap * kLog2e;
      for (int64_t t = 0; t < n; ++t) s[t] = cap2 * __builtin_tanhf(s[t] / cap2);
    }
    if (scores != nullptr)
      for (int k = 0; k < nc; ++k)
        __builtin_memcpy(scores + h * a.held_cap + cur[k].held, s + offs[k],
                         cur[k].n * sizeof(float));
    for (int64_t t = n; t < nv; ++t) s[t] = kNegInf;
    vf mx = splat(kNegInf);
    for (int64_t t = 0; t < nv; t += W) mx = vmax(mx, loadu(s + t));
    float* m = state + h * st;  // m[0] = running max, m[1] = running sum
    const float tile_max = hmax(mx);
    const float m_new = tile_max > m[0] ? tile_max : m[0];
    alpha[h] = vexp2(splat(m[0] - m_new))[0];
    vf sum = splat(0.0f);
    for (int64_t t = 0; t < nv; t += W) {
      const vf p = vexp2(loadu(s + t) - splat(m_new));
      storeu(s + t, p);
      sum += p;
    }
    m[0] = m_new;
    m[1] = m[1] * alpha[h] + hsum(sum);
  }
  const int64_t chunks = d / (2 * W);
  for (int64_t ci = 0; ci < chunks; ++ci)
    value_pass<T, g>(a, cur, nc, nxt, nn, sc, offs, ss, alpha, state, ci, chunks);
}

// Query heads per pass: the largest instantiated block that fits (7 = 4 + 3, 6 = 4 + 2, ...).
static inline int head_block(int64_t remaining) {
  return remaining >= 8 ? 8 : remaining >= 4 ? 4 : (int)remaining;
}

template <typename T>
static void tile_update_heads(const DecodeArgs& a, int g, const PageSpan<T>* cur, int nc,
                              const PageSpan<T>* nxt, int nn, const float* q, float* sc,
                              float* state, float* scores) {
  switch (g) {
#define SKV_CASE(G)                                               \
  case G:                                                         \
    tile_update<T, G>(a, cur, nc, nxt, nn, q, sc, state, scores); \
    break;
    SKV_CASE(1)
    SKV_CASE(2)
    SKV_CASE(3)
    SKV_CASE(4)
    SKV_CASE(8)
#undef SKV_CASE
  }
}

// Fill up to one tile of spans starting at block-table entry *pi; returns the span count.
template <typename T>
static int next_tile(const DecodeArgs& a, const DecodeItem& it, int64_t* pi, PageSpan<T>* out) {
  const int64_t bs = a.block_size, d = a.head_dim;
  const int64_t cap = kTileSlots > bs ? kTileSlots : bs;
  const int64_t page_stride = 2 * a.num_kv_heads * bs * d;
  const T* pool = static_cast<const T*>(a.pool);
  const int64_t* table = a.block_tables + it.b * a.max_blocks;
  int count = 0;
  int64_t slots = 0;
  while (*pi < it.page_end && count < kMaxTilePages) {
    const int64_t base = it.first_slot + *pi * bs;
    const int64_t j0 = it.slot_lo > base ? it.slot_lo - base : 0;
    const int64_t j1 = it.slot_hi - base < bs ? it.slot_hi - base : bs;
    if (count > 0 && slots + (j1 - j0) > cap) break;
    out[count].k = pool + table[*pi] * page_stride + it.kvh * bs * d;
    out[count].j0 = j0;
    out[count].n = j1 - j0;
    out[count].held = *pi * bs + j0;
    slots += j1 - j0;
    ++count;
    ++*pi;
  }
  return count;
}

static int64_t decode_scratch(const DecodeArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t cap = kTileSlots > a.block_size ? kTileSlots : a.block_size;
  return group * a.head_dim + kMaxGroupBlock * (cap + 2 * W) + a.head_dim + group + 2 * W;
}

template <typename T>
static void decode_item_t(const DecodeArgs& a, const DecodeItem& it, float* scratch,
                          float* state) {
  const int64_t G = a.num_heads / a.num_kv_heads, d = a.head_dim, st = d + 2;
  float* q = scratch;  // [G][d], scaled to base-2 logits, chunk order
  float* sc = q + G * d;
  const T* qsrc = static_cast<const T*>(a.query) + (it.b * a.num_heads + it.kvh * G) * d;
  const float qscale = a.scale * kLog2e;
  for (int64_t h = 0; h < G; ++h)
    for (int64_t e = 0; e < d; ++e) q[h * d + chunk_pos<T>(e)] = to_float(qsrc[h * d + e]) * qscale;
  for (int64_t h = 0; h < G; ++h) {
    state[h * st] = kNegInf;
    for (int64_t e = 1; e < st; ++e) state[h * st + e] = 0.0f;
  }
  PageSpan<T> tiles[2][kMaxTilePages];
  int64_t pi = it.page_begin;
  int cur = 0, nc = next_tile<T>(a, it, &pi, tiles[0]);
  while (nc > 0) {
    const int nn = next_tile<T>(a, it, &pi, tiles[1 - cur]);
    for (int64_t h0 = 0, g = 0; h0 < G; h0 += g) {
      g = head_block(G - h0);
      float* scores = nullptr;
      if (a.scores != nullptr)
        scores = a.scores + ((it.b * a.num_kv_heads + it.kvh) * G + h0) * a.held_cap;
      // Later head blocks find the pages in cache: only the first one prefetches.
      tile_update_heads<T>(a, (int)g, tiles[cur], nc, tiles[1 - cur], h0 == 0 ? nn : 0, q + h0 * d,
                           sc, state + h0 * st, scores);
    }
    cur = 1 - cur;
    nc = nn;
  }
}

static void decode_item(const DecodeArgs& a, const DecodeItem& it, float* scratch,
                        float* state) {
  if (a.is_bf16)
    decode_item_t<uint16_t>(a, it, scratch, state);
  else
    decode_item_t<float>(a, it, scratch, state);
}

// Merge split states (base 2), write out, lse (natural log) and the attention mass.
template <typename T>
static void decode_combine_t(const DecodeArgs& a, int64_t b, int64_t kvh, const float* states,
                             int64_t num_splits, int64_t held_lo, int64_t held_hi,
                             float* scratch) {
  const int64_t G = a.num_heads / a.num_kv_heads, d = a.head_dim, st = d + 2;
  const int64_t sstride = G * st;
  T* out = static_cast<T*>(a.out) + (b * a.num_heads + kvh * G) * d;
  float* lse = a.lse + b * a.num_heads + kvh * G;
  float* acc = scratch;     // [d]
  float* lse2 = acc + d;    // [G] base-2 lse
  for (int64_t h = 0; h < G; ++h) {
    float M = kNegInf;
    for (int64_t s = 0; s < num_splits; ++s) {
      const float m = states[s * sstride + h * st];
      M = m > M ? m : M;
    }
    float L = 0.0f;
    for (int64_t e = 0; e < d; ++e) acc[e] = 0.0f;
    if (M != kNegInf) {
      for (int64_t s = 0; s < num_splits; ++s) {
        const float* sp = states + s * sstride + h * st;
        if (sp[0] == kNegInf) continue;
        const float w = __builtin_exp2f(sp[0] - M);
        L += sp[1] * w;
        for (int64_t e = 0; e < d; ++e) acc[e] += sp[2 + e] * w;
      }
    }
    // A request that sees no slot (nothing held) gets a zero output and lse = -inf.
    const float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int64_t e = 0; e < d; ++e) from_float(acc[chunk_pos<T>(e)] * inv, out + h * d + e);
    lse2[h] = L > 0.0f ? M + __builtin_log2f(L) : kNegInf;
    lse[h] = lse2[h] * kLn2;
  }
  if (a.mass == nullptr || held_hi <= held_lo) return;
  float* mass = a.mass + (b * a.num_kv_heads + kvh) * a.held_cap;
  const float* scores = a.scores + (b * a.num_kv_heads + kvh) * G * a.held_cap;
  int64_t t = held_lo;
  for (; t + W <= held_hi; t += W) {
    vf m = splat(0.0f);
    for (int64_t h = 0; h < G; ++h)
      m += vexp2(loadu(scores + h * a.held_cap + t) - splat(lse2[h]));
    storeu(mass + t, m);
  }
  for (; t < held_hi; ++t) {
    float m = 0.0f;
    for (int64_t h = 0; h < G; ++h) m += __builtin_exp2f(scores[h * a.held_cap + t] - lse2[h]);
    mass[t] = m;
  }
}

static void decode_combine(const DecodeArgs& a, int64_t b, int64_t kvh, const float* states,
                           int64_t num_splits, int64_t held_lo, int64_t held_hi,
                           float* scratch) {
  if (a.is_bf16)
    decode_combine_t<uint16_t>(a, b, kvh, states, num_splits, held_lo, held_hi, scratch);
  else
    decode_combine_t<float>(a, b, kvh, states, num_splits, held_lo, held_hi, scratch);
}

// ---------------------------------------------------------------------------------------------
// Window scores: out[h, j] = sum_i exp(q_i . k_j * scale - lse_i) over window rows i that see
// slot j. Key-major: each key row is broadcast against W window rows per vector, so no
// horizontal reduction is needed for the logits.

static int64_t window_scratch(const WindowArgs& a) {
  return kWinSlots * a.head_dim + kWinSlots * a.rows;
}

template <typename T>
static void window_page_t(const WindowArgs& a, int64_t kvh, int64_t pi, float* scratch) {
  const int64_t bs = a.block_size, d = a.head_dim, R = a.rows;
  const int64_t s_begin = pi * bs;
  const int64_t s_end = s_begin + bs < a.num_slots ? s_begin + bs : a.num_slots;
  const T* K = static_cast<const T*>(a.pool) + a.block_table[pi] * 2 * a.num_kv_heads * bs * d +
               kvh * bs * d;
  const float* qt = a.qt + kvh * d * R;
  const float* lse = a.lse + kvh * R;
  float* kf = scratch;              // [kWinSlots][d] fp32 key rows
  float* E = kf + kWinSlots * d;    // [kWinSlots][R] probabilities
  for (int64_t s0 = s_begin; s0 < s_end; s0 += kWinSlots) {
    const int64_t ns = s_end - s0 < kWinSlots ? s_end - s0 : kWinSlots;
    for (int64_t s = 0; s < kWinSlots; ++s)
      for (int64_t c = 0; c < d; ++c)
        kf[s * d + c] = s < ns ? to_float(K[(s0 - s_begin + s) * d + c]) : 0.0f;
    for (int64_t r0 = 0; r0 < R; r0 += kWinRows * W) {
      vf acc[kWinSlots][kWinRows];
      for (int s = 0; s < kWinSlots; ++s)
        for (int r = 0; r < kWinRows; ++r) acc[s][r] = splat(0.0f);
      for (int64_t c = 0; c < d; ++c) {
        vf qv[kWinRows];
        for (int r = 0; r < kWinRows; ++r) qv[r] = loadu(qt + c * R + r0 + r * W);
        for (int s = 0; s < kWinSlots; ++s) {
          const vf k = splat(kf[s * d + c]);
          for (int r = 0; r < kWinRows; ++r) acc[s][r] += k * qv[r];
        }
      }
      for (int s = 0; s < kWinSlots; ++s) {
        const vf slot = splat((float)(s0 + s));
        for (int r = 0; r < kWinRows; ++r) {
          const int64_t row = r0 + r * W;
          const vf e = vexp(acc[s][r] - loadu(lse + row));
          storeu(E + s * R + row, slot <= loadu(a.thr + row) ? e : splat(0.0f));
        }
      }
    }
    for (int64_t s = 0; s < ns; ++s)
      for (int64_t h = 0; h < a.group; ++h) {
        vf sum = splat(0.0f);
        const float* e = E + s * R + h * a.rows_per_head;
        for (int64_t i = 0; i < a.rows_per_head; i += W) sum += loadu(e + i);
        a.out[(kvh * a.group + h) * a.num_slots + s0 + s] = hsum(sum);
      }
  }
}

static void window_page(const WindowArgs& a, int64_t kvh, int64_t pi, float* scratch) {
  if (a.is_bf16)
    window_page_t<uint16_t>(a, kvh, pi, scratch);
  else
    window_page_t<float>(a, kvh, pi, scratch);
}
