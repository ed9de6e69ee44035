// Decode attention (part of kernel_impl.h).
//
// An item walks its pages in tiles of up to kTileSlots slots (one online-softmax update per
// tile, not per page). Logits are kept in base 2 (q is pre-scaled by scale * log2(e)). While a
// tile is processed, the next tile's key rows are prefetched during the logits and its value
// rows during the value pass, so memory stays busy in both phases (block tables are not
// sequential, so the hardware prefetcher cannot find the next page). Those row prefetches go
// to L2 (prefetcht1), not L1: an L1 prefetch holds one of the core's few L1 miss buffers until
// its line arrives from DRAM, which capped one core at ~8.5 GB/s of K/V; L2 prefetches have
// more lines in flight (10-13 GB/s on a Zen 4 core, 16 x 1040 slots, bf16), and the line moves
// from L2 to L1 while the previous rows are computed.
//
// T is the pool's element type: float, uint16_t (bf16), or the codes int8_t and fp8_e4m3 of
// a quantized pool, whose per-slot scales multiply each logit (key scale) and each value row's
// probability (value scale) after the softmax sums; see load_chunk and CodeUnit in vec_impl.h.
// T = int4x2 reads KIVI int4 pages (int4_impl.h): the query is rescaled per page by the key
// scales, a bias per head adds the key zeros, and the value zeros enter through one sum per
// head and tile. Rows of T elements are row_len<T>(head_dim) long (int4: two codes per byte).

constexpr int64_t kTileSlots = 32;
constexpr int kMaxTilePages = 8;

template <typename T>
static inline int64_t row_len(int64_t head_dim) {  // elements of T per key or value row
  return kInt4<T> ? head_dim / 2 : head_dim;
}

template <typename T>
struct PageSpan {  // slots [j0, j0 + n) of one page of one KV head
  const T* k;      // the head's key rows of the page (values follow at + kv_stride)
  const float* ks;  // quantized pools: the head's key scales of the page (values' follow at
                    // + num_kv_heads * block_size); else nullptr
  int64_t j0, n;
  int64_t held;  // held index of slot j0
  int64_t ph;    // page * num_kv_heads + KV head: the int4 scales' (page, head) index
};

template <typename T>  // rows [r0, r1) of the span, rl elements each, at + offset, into L2
static inline void prefetch_rows(const PageSpan<T>* p, int64_t offset, int64_t rl, int64_t r0,
                                 int64_t r1) {
  if (p == nullptr) return;
  r1 = r1 < p->n ? r1 : p->n;
  if (r1 <= r0) return;
  const char* base = reinterpret_cast<const char*>(p->k + offset + (p->j0 + r0) * rl);
  const int64_t bytes = (r1 - r0) * rl * (int64_t)sizeof(T);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + o, 0, 2);
}

// Touch the first line of every key and value run of a tile: the L2 streamer then fetches the
// rest of each run by itself, more lines in flight than software prefetches can keep (they
// hold one of ~16 line fill buffers each). Done two tiles ahead; see decode_item_t.
// Quantized pools: every line of the span's key and value scales is read, a demand load rather
// than a prefetch: prefetching them changed nothing (41 ns per slot and KV head, int8, one
// thread, 368 MB of codes), reading them two tiles ahead gave 28 ns (26 with the scales in L1).
// int4 pools: their key and value scales and zeros are prefetched (touch_int4_scales).
template <typename T>
static inline void touch_runs(const DecodeArgs& a, const PageSpan<T>* spans, int n,
                              int64_t kv_stride, int64_t rl) {
  for (int k = 0; k < n; ++k) {
    __builtin_prefetch(spans[k].k + spans[k].j0 * rl, 0, 3);
    __builtin_prefetch(spans[k].k + kv_stride + spans[k].j0 * rl, 0, 3);
    if (kInt4<T> && spans[k].n > 0) touch_int4_scales(a, spans[k].ph, spans[k].j0, spans[k].n);
    if (kQuantized<T> && spans[k].n > 0) {
      const float* ks = spans[k].ks + spans[k].j0;
      const int64_t vs = kv_stride / rl, last = spans[k].n - 1;
      volatile float sink;  // forces the loads
      for (int64_t t = 0; t < last; t += 16) sink = ks[t] + ks[vs + t];
      sink = ks[last] + ks[vs + last];
      (void)sink;
    }
  }
}

// Dot products of two key rows with the g query rows of q (stride d, chunk order).
template <typename T, int g>
static inline void dot2(const T* k0, const T* k1, const float* q, int64_t d, vf* a0, vf* a1) {
  for (int h = 0; h < g; ++h) a0[h] = a1[h] = splat(0.0f);
  for (int64_t c = 0; c < d; c += 2 * W) {
    vf k0e, k0o, k1e, k1o;
    load_chunk(k0, c, k0e, k0o);
    load_chunk(k1, c, k1e, k1o);
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
    load_chunk(k, c, ke, ko);
    for (int h = 0; h < g; ++h) a[h] += loadu(q + h * d + c) * ke + loadu(q + h * d + c + W) * ko;
  }
}

// Logits of the span's slots for g heads into sc[h * ss + t], t < span.n (a W-slot group may
// write up to W - 1 values past n; the caller's buffer has room and overwrites them). Quantized
// pools: dot(q, codes) times the slot's key scale; int4: dot(q, codes) + bias[h], q the query
// scaled by the page's key scales (int4_page_query). D > 0: head_dim known at compile time
// (must equal d), so the chunk loops unroll and the g query rows stay in registers across the
// key rows instead of being re-read from L1 for each (see kFixedHeadDimVectors).
template <typename T, int g, int D = 0>
static inline void span_logits(const PageSpan<T>& sp, const PageSpan<T>* next, int64_t bs,
                               int64_t d_runtime, const float* q, const float* bias, float* sc,
                               int64_t ss) {
  const int64_t d = D > 0 ? D : d_runtime;
  const T* K = sp.k;
  const int64_t rl = row_len<T>(d);
  int64_t j = sp.j0;
  const int64_t j1 = sp.j0 + sp.n;
  for (; j < j1 && j + W <= bs; j += W) {  // W slots at once; rows past j1 are ignored
    vf part[g][W];
    for (int jj = 0; jj < W; jj += 2) {
      prefetch_rows(next, 0, rl, j - sp.j0 + jj, j - sp.j0 + jj + 2);
      vf a0[g], a1[g];
      dot2<T, g>(K + (j + jj) * rl, K + (j + jj + 1) * rl, q, d, a0, a1);
      for (int h = 0; h < g; ++h) {
        part[h][jj] = a0[h];
        part[h][jj + 1] = a1[h];
      }
    }
    if (kQuantized<T>) {
      const vf kscale = loadu(sp.ks + j) * splat(CodeUnit<T>::value);
      for (int h = 0; h < g; ++h)
        storeu(sc + h * ss + (j - sp.j0), reduce_lanes(part[h]) * kscale);
    } else if (kInt4<T>) {
      for (int h = 0; h < g; ++h)
        storeu(sc + h * ss + (j - sp.j0), reduce_lanes(part[h]) + splat(bias[h]));
    } else {
      for (int h = 0; h < g; ++h) storeu(sc + h * ss + (j - sp.j0), reduce_lanes(part[h]));
    }
  }
  for (; j < j1; ++j) {
    prefetch_rows(next, 0, rl, j - sp.j0, j - sp.j0 + 1);
    vf a[g];
    dot1<T, g>(K + j * rl, q, d, a);
    const float kscale = kQuantized<T> ? sp.ks[j] * CodeUnit<T>::value : 1.0f;
    for (int h = 0; h < g; ++h)
      sc[h * ss + (j - sp.j0)] = hsum(a[h]) * kscale + (kInt4<T> ? bias[h] : 0.0f);
  }
  prefetch_rows(next, 0, rl, sp.n, bs);  // rows the next span has beyond this one's
}

// The query rows of a head block, in W-lane vectors, that span_logits keeps in registers
// (a compile-time head_dim): 24 of AVX-512's 32, leaving room for the accumulators and key
// chunks. One Zen 4 core, bf16 pages in L1: 17.7 -> 14.1 ns per slot and KV head at group 3,
// head_dim 64; at group 8 / head_dim 128 (64 vectors) the spills made it slower.
constexpr int kFixedHeadDimVectors = 24;

// span_logits with the head dims models use compiled in where their query rows fit registers.
template <typename T, int g>
static inline void tile_span_logits(const PageSpan<T>& sp, const PageSpan<T>* next, int64_t bs,
                                    int64_t d, const float* q, float* sc, int64_t ss) {
  if constexpr (W == 16 && g * 64 / W <= kFixedHeadDimVectors) {
    if (d == 64) return span_logits<T, g, 64>(sp, next, bs, d, q, nullptr, sc, ss);
  }
  if constexpr (W == 16 && g * 128 / W <= kFixedHeadDimVectors) {
    if (d == 128) return span_logits<T, g, 128>(sp, next, bs, d, q, nullptr, sc, ss);
  }
  span_logits<T, g>(sp, next, bs, d, q, nullptr, sc, ss);
}

// acc[h] = acc[h] * alpha[h] + sum_t p[h][t] * v[t] over chunk ci of head_dim (2W elements);
// int4: + zsum[h] (the value zeros' part) on every channel.
template <typename T, int g>
static inline void value_pass(const DecodeArgs& a, const PageSpan<T>* cur, int nc,
                              const PageSpan<T>* nxt, int nn, const float* sc,
                              const int64_t* offs, int64_t ss, const float* alpha,
                              const float* zsum, float* state, int64_t ci, int64_t chunks) {
  const int64_t d = a.head_dim, st = d + 2, c = ci * 2 * W, rl = row_len<T>(d);
  const int64_t kv_stride = a.num_kv_heads * a.block_size * rl;
  vf ae[g], ao[g];
  for (int h = 0; h < g; ++h) {
    const vf zero_part = splat(kInt4<T> ? zsum[h] : 0.0f);
    ae[h] = loadu(state + h * st + 2 + c) * splat(alpha[h]) + zero_part;
    ao[h] = loadu(state + h * st + 2 + c + W) * splat(alpha[h]) + zero_part;
  }
  for (int k = 0; k < nc; ++k) {
    if (k < nn) {  // this chunk's share of the next tile's value rows
      const int64_t rows = nxt[k].n;
      prefetch_rows(nxt + k, kv_stride, rl, ci * rows / chunks, (ci + 1) * rows / chunks);
    }
    const T* V = cur[k].k + kv_stride + cur[k].j0 * rl;
    const float* p = sc + offs[k];
    for (int64_t t = 0; t < cur[k].n; ++t) {
      vf ve, vo;
      load_chunk(V + t * rl, c, ve, vo);
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

// Online-softmax step of a tile for g heads: turns the base-2 logits sc[h * ss + t], t < n, into
// probabilities 2^(logit - new max) (zero up to the next multiple of W), updates each head's
// [max, sum] in `state` and returns the factor alpha[h] its accumulator must be scaled by.
// Raw logits (after the soft-cap) are copied to `scores` when asked.
template <typename T>
static inline void tile_softmax(const DecodeArgs& a, int g, const PageSpan<T>* cur, int nc,
                                const int64_t* offs, float* sc, int64_t ss, float* state,
                                float* scores, float* alpha) {
  const int64_t st = a.head_dim + 2, n = offs[nc], nv = (n + W - 1) / W * W;
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
}

// Quantized pools: the probabilities of g heads times each slot's value scale (and CodeUnit),
// the coefficients of the code rows in the value pass. vs: scratch of the tile's length + W.
template <typename T>
static inline void value_coefficients(const DecodeArgs& a, int g, const PageSpan<T>* cur,
                                      int nc, const int64_t* offs, float* sc, int64_t ss,
                                      float* vs) {
  const int64_t to_values = a.num_kv_heads * a.block_size, n = offs[nc];
  const int64_t nv = (n + W - 1) / W * W;
  for (int k = 0; k < nc; ++k) {
    const float* src = cur[k].ks + to_values + cur[k].j0;
    for (int64_t t = 0; t < cur[k].n; ++t) vs[offs[k] + t] = src[t] * CodeUnit<T>::value;
  }
  for (int64_t t = n; t < nv; ++t) vs[t] = 0.0f;
  for (int h = 0; h < g; ++h) {
    float* p = sc + h * ss;
    for (int64_t t = 0; t < nv; t += W) storeu(p + t, loadu(p + t) * loadu(vs + t));
  }
}

// Online-softmax update of g heads with one tile. state: per head [max, sum, acc[d]] (base 2).
// vs: scratch of quantized pools (value_coefficients); int4 pools: [vs: ss][vz: ss][qs: g * d]
// (value scales and zeros of the tile, the query scaled for one page).
template <typename T, int g>
static void tile_update(const DecodeArgs& a, const PageSpan<T>* cur, int nc,
                        const PageSpan<T>* nxt, int nn, const float* q, float* sc,
                        float* state, float* scores, float* vs) {
  const int64_t d = a.head_dim, bs = a.block_size;
  const int64_t cap = kTileSlots > bs ? kTileSlots : bs, ss = cap + 2 * W;
  float* vz = vs + ss;
  float* qs = vz + ss;
  float bias[g], zsum[g];
  int64_t offs[kMaxTilePages + 1];
  offs[0] = 0;
  for (int k = 0; k < nc; ++k) {
    const PageSpan<T>* next = k < nn ? nxt + k : nullptr;
    if (kInt4<T>) {
      int4_page_query<g>(a, cur[k].ph, q, qs, bias);
      span_logits<T, g>(cur[k], next, bs, d, qs, bias, sc + offs[k], ss);
      int4_stage_values(a, cur[k].ph, cur[k].j0, cur[k].n, vs + offs[k], vz + offs[k]);
    } else {
      tile_span_logits<T, g>(cur[k], next, bs, d, q, sc + offs[k], ss);
    }
    offs[k + 1] = offs[k] + cur[k].n;
  }
  float alpha[g];
  tile_softmax<T>(a, g, cur, nc, offs, sc, ss, state, scores, alpha);
  if (kQuantized<T>) value_coefficients<T>(a, g, cur, nc, offs, sc, ss, vs);
  if (kInt4<T>) int4_value_coefficients(g, offs[nc], sc, ss, vs, vz, zsum);
  const int64_t chunks = d / (2 * W);
  for (int64_t ci = 0; ci < chunks; ++ci)
    value_pass<T, g>(a, cur, nc, nxt, nn, sc, offs, ss, alpha, zsum, state, ci, chunks);
}

// Query heads per pass: the largest instantiated block that fits (7 = 4 + 3, 6 = 4 + 2, ...).
static inline int head_block(int64_t remaining) {
  return remaining >= 8 ? 8 : remaining >= 4 ? 4 : (int)remaining;
}

template <typename T>
static void tile_update_heads(const DecodeArgs& a, int g, const PageSpan<T>* cur, int nc,
                              const PageSpan<T>* nxt, int nn, const float* q, float* sc,
                              float* state, float* scores, float* vs) {
  switch (g) {
#define SKV_CASE(G)                                                   \
  case G:                                                             \
    tile_update<T, G>(a, cur, nc, nxt, nn, q, sc, state, scores, vs); \
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
  const int64_t bs = a.block_size, rl = row_len<T>(a.head_dim);
  const int64_t cap = kTileSlots > bs ? kTileSlots : bs;
  const int64_t page_stride = 2 * a.num_kv_heads * bs * rl;
  const T* pool = static_cast<const T*>(a.pool);
  const int64_t* table = a.block_tables + it.b * a.max_blocks;
  int count = 0;
  int64_t slots = 0;
  while (*pi < it.page_end && count < kMaxTilePages) {
    const int64_t base = it.first_slot + *pi * bs;
    const int64_t j0 = it.slot_lo > base ? it.slot_lo - base : 0;
    const int64_t j1 = it.slot_hi - base < bs ? it.slot_hi - base : bs;
    if (count > 0 && slots + (j1 - j0) > cap) break;
    out[count].k = pool + table[*pi] * page_stride + it.kvh * bs * rl;
    out[count].ks = a.kv_scales == nullptr
                        ? nullptr
                        : a.kv_scales + table[*pi] * 2 * a.num_kv_heads * bs + it.kvh * bs;
    out[count].j0 = j0;
    out[count].n = j1 - j0;
    out[count].held = *pi * bs + j0;
    out[count].ph = table[*pi] * a.num_kv_heads + it.kvh;
    slots += j1 - j0;
    ++count;
    ++*pi;
  }
  return count;
}

static int64_t decode_scratch(const DecodeArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t cap = kTileSlots > a.block_size ? kTileSlots : a.block_size;
  const int64_t int4 = a.kv_type == kKvInt4 ? (cap + 2 * W) + kMaxGroupBlock * a.head_dim : 0;
  return group * a.head_dim + (kMaxGroupBlock + 1) * (cap + 2 * W) + a.head_dim + group + 2 * W +
         int4;
}

template <typename T>
static void decode_item_t(const DecodeArgs& a, const DecodeItem& it, float* scratch,
                          float* state) {
  const int64_t G = a.num_heads / a.num_kv_heads, d = a.head_dim, st = d + 2;
  const int64_t ss = (kTileSlots > a.block_size ? kTileSlots : a.block_size) + 2 * W;
  float* q = scratch;  // [G][d], scaled to base-2 logits, chunk order
  float* sc = q + G * d;                  // [kMaxGroupBlock][ss]
  float* vs = sc + kMaxGroupBlock * ss;   // [ss] value coefficients (quantized pools; int4:
                                          // and the tile_update scratch after it)
  const int64_t q0 = (it.b * a.num_heads + it.kvh * G) * d;
  const float qscale = a.scale * kLog2e * CodeUnit<T>::value;
  for (int64_t h = 0; h < G; ++h)
    for (int64_t e = 0; e < d; ++e) {
      const int64_t i = q0 + h * d + e;
      const float x = a.query_bf16 ? to_float(static_cast<const uint16_t*>(a.query)[i])
                                   : static_cast<const float*>(a.query)[i];
      q[h * d + chunk_pos<T>(e)] = x * qscale;
    }
  for (int64_t h = 0; h < G; ++h) {
    state[h * st] = kNegInf;
    for (int64_t e = 1; e < st; ++e) state[h * st + e] = 0.0f;
  }
  // A ring of three tiles: the current one, the next (prefetched row by row during the
  // current one's logit and value passes) and the one after (runs touched, see touch_runs).
  const int64_t rl = row_len<T>(d), kv_stride = a.num_kv_heads * a.block_size * rl;
  PageSpan<T> tiles[3][kMaxTilePages];
  int count[3];
  int64_t pi = it.page_begin;
  for (int i = 0; i < 2; ++i) {
    count[i] = next_tile<T>(a, it, &pi, tiles[i]);
    touch_runs(a, tiles[i], count[i], kv_stride, rl);
  }
  for (int cur = 0; count[cur] > 0; cur = (cur + 1) % 3) {
    const int next = (cur + 1) % 3, after = (cur + 2) % 3;
    count[after] = next_tile<T>(a, it, &pi, tiles[after]);
    touch_runs(a, tiles[after], count[after], kv_stride, rl);
    for (int64_t h0 = 0, g = 0; h0 < G; h0 += g) {
      g = head_block(G - h0);
      float* scores = nullptr;
      if (a.scores != nullptr)
        scores = a.scores + ((it.b * a.num_kv_heads + it.kvh) * G + h0) * a.held_cap;
      // Later head blocks find the pages in cache: only the first one prefetches.
      tile_update_heads<T>(a, (int)g, tiles[cur], count[cur], tiles[next],
                           h0 == 0 ? count[next] : 0, q + h0 * d, sc, state + h0 * st, scores,
                           vs);
    }
  }
}

static void decode_item(const DecodeArgs& a, const DecodeItem& it, float* scratch,
                        float* state) {
  switch (a.kv_type) {
    case kKvBFloat16:
      decode_item_t<uint16_t>(a, it, scratch, state);
      break;
    case kKvInt8:
      decode_item_t<int8_t>(a, it, scratch, state);
      break;
    case kKvFp8E4M3:
      decode_item_t<fp8_e4m3>(a, it, scratch, state);
      break;
    case kKvInt4:
      decode_item_t<int4x2>(a, it, scratch, state);
      break;
    default:
      decode_item_t<float>(a, it, scratch, state);
  }
}
