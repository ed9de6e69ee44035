// bf16 decode attention with AVX512-BF16 dot products (included by decode_avx512_bf16.cpp
// after kernel_impl.h, whose tiles, prefetches, online softmax and split merge it shares).
//
// Why: the vector kernel widens every bf16 key and value element to fp32 before its FMAs, and
// at GQA group 3 and head_dim 64 it is bound by that arithmetic, not by memory. VDPBF16PS
// multiplies 32 bf16 pairs into 16 fp32 lanes in one instruction, straight from the page's
// bits, so both products take about half the instructions:
// - logits: each key row (its bf16 elements are already pair after pair) against the query's
//   bf16 pairs, one instruction per 32 elements and head; the 16 rows of a page are then summed
//   into one vector of 16 logits by the transposing reduction of the vector kernel. The query
//   is the raw bf16 input, unscaled, so every product is exact; the scale multiplies the fp32
//   logits.
// - values: rows t, t + 1 of the tile interleaved into pairs (unpacklo/hi_epi16, per 128-bit
//   lane: hence chunk_pos's paired order in this unit, as on AMX) against each head's
//   probability pair (p[t], p[t + 1]) rounded to bf16; the softmax denominator sums the
//   unrounded fp32 probabilities, as AMX's and bf16 flash attention's do.

constexpr int kBf16MaxHeads = 4;  // query heads per pass: accumulators stay in registers

struct Bf16Scratch {
  uint32_t* qpairs;       // [G][d / 2] the query's bf16 pairs
  float* sc;              // [kBf16MaxHeads][ss] logits, then probabilities
  uint32_t* pb;           // [kBf16MaxHeads][ss / 2] probability pairs in bf16
  uint16_t* zero_row;     // [d] zeros: the partner of a tile's odd last value row
  const uint16_t** rows;  // [ss] the tile's value rows, then zero_row
  const uint16_t** next;  // [ss] the next tile's value rows (prefetched during the values)
  int64_t ss;
};

// Floats of Bf16Scratch (carved from `base` into `out` when given).
static int64_t bf16_decode_scratch(const DecodeArgs& a, float* base, Bf16Scratch* out) {
  const int64_t G = a.num_heads / a.num_kv_heads, d = a.head_dim;
  const int64_t cap = kTileSlots > a.block_size ? kTileSlots : a.block_size;
  const int64_t ss = cap + 2 * W;  // even: pairs never straddle two heads' rows
  const int64_t sizes[6] = {G * d / 2, kBf16MaxHeads * ss, kBf16MaxHeads * ss / 2, d / 2,
                            2 * ss, 2 * ss};
  float* parts[6];
  const int64_t used = carve_scratch(base, sizes, 6, parts);
  if (out != nullptr)
    *out = {reinterpret_cast<uint32_t*>(parts[0]), parts[1],
            reinterpret_cast<uint32_t*>(parts[2]), reinterpret_cast<uint16_t*>(parts[3]),
            reinterpret_cast<const uint16_t**>(parts[4]),
            reinterpret_cast<const uint16_t**>(parts[5]), ss};
  return used;
}

static inline vf bf16_dot(vf acc, __m512i a, __m512i b) {
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}

// Pairwise partial sums of q[h] . k for g heads: lane i of acc[h] holds the products of
// elements 2i, 2i + 1 of each 32-element chunk; their lane sum is the dot product.
template <int g>
static inline void bf16_row_dots(const uint16_t* k, const uint32_t* qp, int64_t d, vf* acc) {
  for (int h = 0; h < g; ++h) acc[h] = splat(0.0f);
  for (int64_t c = 0; c < d; c += 2 * W) {
    const __m512i kc = _mm512_loadu_si512(k + c);
    for (int h = 0; h < g; ++h)
      acc[h] = bf16_dot(acc[h], kc, _mm512_loadu_si512(qp + h * (d / 2) + c / 2));
  }
}

// Base-2 logits of the span's slots for g heads into sc[h * ss + t], t < span.n (a 16-row
// group may write up to 15 values past n, as span_logits does); the next tile's key rows are
// prefetched as this span's are read.
template <int g>
static inline void bf16_span_logits(const PageSpan<uint16_t>& sp, const PageSpan<uint16_t>* next,
                                    int64_t bs, int64_t d, const uint32_t* qp, float qscale,
                                    float* sc, int64_t ss) {
  const uint16_t* K = sp.k;
  int64_t j = sp.j0;
  const int64_t j1 = sp.j0 + sp.n;
  for (; j < j1 && j + W <= bs; j += W) {  // 16 rows of the page; rows past j1 are ignored
    vf quad[4][g];
    for (int m = 0; m < 4; ++m) {
      const int64_t r = j + 4 * m;
      prefetch_rows(next, 0, d, r - sp.j0, r - sp.j0 + 4);
      vf part[4][g];
      for (int i = 0; i < 4; ++i) bf16_row_dots<g>(K + (r + i) * d, qp, d, part[i]);
      for (int h = 0; h < g; ++h) quad[m][h] = quad_sum(part[0][h], part[1][h], part[2][h], part[3][h]);
    }
    for (int h = 0; h < g; ++h) {
      const vf c[4] = {quad[0][h], quad[1][h], quad[2][h], quad[3][h]};
      storeu(sc + h * ss + (j - sp.j0), reduce_quads(c) * splat(qscale));
    }
  }
  for (; j < j1; ++j) {
    prefetch_rows(next, 0, d, j - sp.j0, j - sp.j0 + 1);
    vf acc[g];
    bf16_row_dots<g>(K + j * d, qp, d, acc);
    for (int h = 0; h < g; ++h) sc[h * ss + (j - sp.j0)] = hsum(acc[h]) * qscale;
  }
  prefetch_rows(next, 0, d, sp.n, bs);  // rows the next span has beyond this one's
}

// Value row pointers of a tile's slots into rows[0, n), then zero_row up to the next even
// count; returns the number of row pairs.
static inline int64_t bf16_value_rows(const PageSpan<uint16_t>* spans, int count,
                                      int64_t kv_stride, int64_t d, const uint16_t* zero_row,
                                      const uint16_t** rows) {
  int64_t t = 0;
  for (int k = 0; k < count; ++k)
    for (int64_t j = 0; j < spans[k].n; ++j) rows[t++] = spans[k].k + kv_stride + (spans[k].j0 + j) * d;
  const int64_t pairs = (t + 1) / 2;
  for (; t < 2 * pairs; ++t) rows[t] = zero_row;
  return pairs;
}

// Probabilities of g heads (fp32, zero from n up to a multiple of W) as bf16 pairs: word i of
// pb[h * ss / 2 + ...] holds (p[2i], p[2i + 1]), rounded to nearest even.
static inline void bf16_probability_pairs(float* sc, int64_t ss, int g, int64_t n,
                                          uint32_t* pb) {
  const int64_t nv = (n + W - 1) / W * W, n32 = (n + 2 * W - 1) / (2 * W) * (2 * W);
  for (int h = 0; h < g; ++h) {
    float* s = sc + h * ss;
    for (int64_t t = nv; t < n32; ++t) s[t] = 0.0f;
    for (int64_t t = 0; t < n32; t += 2 * W) {
      const __m512bh words = _mm512_cvtne2ps_pbh((__m512)loadu(s + t + W), (__m512)loadu(s + t));
      _mm512_storeu_si512(pb + h * (ss / 2) + t / 2, (__m512i)words);
    }
  }
}

// acc[h] = acc[h] * alpha[h] + sum_t p[h][t] v[t] over elements [c0, c0 + 32 * CP) of g heads,
// accumulators in the paired chunk order (lo: elements r % 8 < 4 of each 128-bit lane).
template <int g, int CP>
static inline void bf16_value_block(const uint16_t* const* rows, int64_t pairs,
                                    const uint16_t* const* next, int64_t next_rows,
                                    const uint32_t* pb, int64_t pss, const float* alpha,
                                    float* state, int64_t st, int64_t c0, bool prefetch) {
  vf acc[g][2 * CP];
  for (int h = 0; h < g; ++h)
    for (int i = 0; i < 2 * CP; ++i)
      acc[h][i] = loadu(state + h * st + 2 + c0 + i * W) * splat(alpha[h]);
  for (int64_t p = 0; p < pairs; ++p) {
    if (prefetch)
      for (int64_t r = 2 * p; r < 2 * p + 2 && r < next_rows; ++r)
        for (int c = 0; c < CP; ++c) __builtin_prefetch(next[r] + c0 + c * 2 * W, 0, 3);
    __m512i w[g];
    for (int h = 0; h < g; ++h) w[h] = _mm512_set1_epi32((int32_t)pb[h * pss + p]);
    for (int c = 0; c < CP; ++c) {
      const __m512i v0 = _mm512_loadu_si512(rows[2 * p] + c0 + c * 2 * W);
      const __m512i v1 = _mm512_loadu_si512(rows[2 * p + 1] + c0 + c * 2 * W);
      const __m512i lo = _mm512_unpacklo_epi16(v0, v1), hi = _mm512_unpackhi_epi16(v0, v1);
      for (int h = 0; h < g; ++h) {
        acc[h][2 * c] = bf16_dot(acc[h][2 * c], lo, w[h]);
        acc[h][2 * c + 1] = bf16_dot(acc[h][2 * c + 1], hi, w[h]);
      }
    }
  }
  for (int h = 0; h < g; ++h)
    for (int i = 0; i < 2 * CP; ++i) storeu(state + h * st + 2 + c0 + i * W, acc[h][i]);
}

// Online-softmax update of g heads with one tile (the vector kernel's tile_update on bf16
// dot products). nxt / nn: the next tile, whose key and value rows are prefetched when given.
template <int g>
static void bf16_tile_update(const DecodeArgs& a, const PageSpan<uint16_t>* cur, int nc,
                             const PageSpan<uint16_t>* nxt, int nn, const uint32_t* qp,
                             float* state, float* scores, const Bf16Scratch& w) {
  const int64_t d = a.head_dim, st = d + 2, bs = a.block_size;
  const int64_t kv_stride = a.num_kv_heads * bs * d;
  const float qscale = a.scale * kLog2e;
  int64_t offs[kMaxTilePages + 1];
  offs[0] = 0;
  for (int k = 0; k < nc; ++k) {
    bf16_span_logits<g>(cur[k], k < nn ? nxt + k : nullptr, bs, d, qp, qscale, w.sc + offs[k],
                        w.ss);
    offs[k + 1] = offs[k] + cur[k].n;
  }
  float alpha[g];
  tile_softmax<uint16_t>(a, g, cur, nc, offs, w.sc, w.ss, state, scores, alpha);
  bf16_probability_pairs(w.sc, w.ss, g, offs[nc], w.pb);
  const int64_t pairs = bf16_value_rows(cur, nc, kv_stride, d, w.zero_row, w.rows);
  const int64_t next_rows = nn > 0 ? bf16_value_rows(nxt, nn, kv_stride, d, w.zero_row, w.next) : 0;
  int64_t c0 = 0;
  for (; c0 + 4 * W <= d; c0 += 4 * W)  // two 32-element chunks per pass
    bf16_value_block<g, 2>(w.rows, pairs, w.next, next_rows, w.pb, w.ss / 2, alpha, state, st,
                           c0, nn > 0);
  if (c0 < d)
    bf16_value_block<g, 1>(w.rows, pairs, w.next, next_rows, w.pb, w.ss / 2, alpha, state, st,
                           c0, nn > 0);
}

static void bf16_tile_update_heads(const DecodeArgs& a, int g, const PageSpan<uint16_t>* cur,
                                   int nc, const PageSpan<uint16_t>* nxt, int nn,
                                   const uint32_t* qp, float* state, float* scores,
                                   const Bf16Scratch& w) {
  switch (g) {
#define SKV_CASE(G)                                                       \
  case G:                                                                 \
    bf16_tile_update<G>(a, cur, nc, nxt, nn, qp, state, scores, w);       \
    break;
    SKV_CASE(1)
    SKV_CASE(2)
    SKV_CASE(3)
    SKV_CASE(4)
#undef SKV_CASE
  }
}

// The query of (b, kvh) as bf16 pairs, unscaled: the raw bits of a bf16 query, an fp32 one
// rounded to nearest even.
static void bf16_query_pairs(const DecodeArgs& a, const DecodeItem& it, uint32_t* qp) {
  const int64_t G = a.num_heads / a.num_kv_heads, d = a.head_dim;
  const int64_t q0 = (it.b * a.num_heads + it.kvh * G) * d;
  uint16_t* q16 = reinterpret_cast<uint16_t*>(qp);
  for (int64_t e = 0; e < G * d; ++e) {
    if (a.query_bf16)
      q16[e] = static_cast<const uint16_t*>(a.query)[q0 + e];
    else
      from_float(static_cast<const float*>(a.query)[q0 + e], q16 + e);
  }
}

static void decode_item_bf16(const DecodeArgs& a, const DecodeItem& it, float* scratch,
                             float* state) {
  const int64_t G = a.num_heads / a.num_kv_heads, d = a.head_dim, st = d + 2;
  const int64_t kv_stride = a.num_kv_heads * a.block_size * d;
  Bf16Scratch w;
  bf16_decode_scratch(a, scratch + (16 - (reinterpret_cast<uintptr_t>(scratch) / 4) % 16) % 16,
                      &w);
  for (int64_t e = 0; e < d; ++e) w.zero_row[e] = 0;
  bf16_query_pairs(a, it, w.qpairs);
  for (int64_t h = 0; h < G; ++h) {
    state[h * st] = kNegInf;
    for (int64_t e = 1; e < st; ++e) state[h * st + e] = 0.0f;
  }
  // The vector kernel's ring of three tiles: the current one, the next (prefetched row by row
  // during the current one's logits and values) and the one after (its runs touched).
  PageSpan<uint16_t> tiles[3][kMaxTilePages];
  int count[3];
  int64_t pi = it.page_begin;
  for (int i = 0; i < 2; ++i) {
    count[i] = next_tile<uint16_t>(a, it, &pi, tiles[i]);
    touch_runs(a, tiles[i], count[i], kv_stride, d);
  }
  for (int cur = 0; count[cur] > 0; cur = (cur + 1) % 3) {
    const int next = (cur + 1) % 3, after = (cur + 2) % 3;
    count[after] = next_tile<uint16_t>(a, it, &pi, tiles[after]);
    touch_runs(a, tiles[after], count[after], kv_stride, d);
    for (int64_t h0 = 0, g = 0; h0 < G; h0 += g) {
      g = G - h0 < kBf16MaxHeads ? G - h0 : kBf16MaxHeads;
      float* scores = nullptr;
      if (a.scores != nullptr)
        scores = a.scores + ((it.b * a.num_kv_heads + it.kvh) * G + h0) * a.held_cap;
      // Later head blocks find the pages in cache: only the first one prefetches.
      bf16_tile_update_heads(a, (int)g, tiles[cur], count[cur], tiles[next],
                             h0 == 0 ? count[next] : 0, w.qpairs + h0 * d / 2, state + h0 * st,
                             scores, w);
    }
  }
}

// Table entries of this unit: bf16 pools on the dot-product kernel, the others on the vector
// kernel (whose chunk order for them does not depend on SKV_BF16_PAIRS).
static int64_t decode_scratch_or_bf16(const DecodeArgs& a) {
  const int64_t vector = decode_scratch(a), dots = bf16_decode_scratch(a, nullptr, nullptr) + 16;
  return vector > dots ? vector : dots;
}

static void decode_item_or_bf16(const DecodeArgs& a, const DecodeItem& it, float* scratch,
                                float* state) {
  if (a.kv_type == kKvBFloat16)
    decode_item_bf16(a, it, scratch, state);
  else
    decode_item(a, it, scratch, state);
}
