// Causal prefill (flash) attention in fp32 with FMAs, written once with GCC vector extensions
// (W fp32 lanes; included by isa_avx512.cpp, isa_avx2.cpp and isa_generic.cpp after
// kernel_impl.h, interface in prefill.h): the fallback for CPUs without AVX512-BF16, reading K
// and V converted to fp32 by the binding, and the kernel of fp32 models (fp32 queries and
// outputs: no rounding anywhere, logits and probabilities fp32 end to end).
//
// The structure of the bf16 kernels (prefill_softmax.h): one work item is a block of query
// rows of every query head of one KV head, transposed so that W query columns share a vector,
// key blocks of kPrefillKeyBlock; the softmax is the online one with a lazy max (as in
// prefill_softmax.h: a block is exponentiated against the column's current max and kept if its
// sum stays within kFmaLazySum, otherwise redone with a max pass and the new max), with the
// probabilities kept in fp32 for the value product:
//   S^T[key][W cols] += K[key][e] * Q^T[e][W cols]          (broadcast key element, FMA)
//   O^T[dim][W cols] += V[key][dim] * P^T[key][W cols]      (broadcast value element, FMA)
// in register blocks of kFmaRows rows by up to 3 column vectors (12 accumulators, within the 16
// registers of AVX2). Logits are natural (the scale folded into the queries) and each
// exponent is (logit - max) * log2(e), subtracted before the change of base: the difference of
// two nearby logits is exact, so a logit of magnitude L carries only its own rounding
// (L * 2^-24), not that of L * log2(e) as well (base-2 logits had 3x the fp32 reference's error
// at L ~ 60).

constexpr int64_t kFKeys = kPrefillKeyBlock;
constexpr int kFmaRows = 4;
constexpr float kFmaNoMax = -1e30f;  // the running max before a key: see prefill_softmax.h
// A block's probabilities against a column's current max may sum to this much before the max
// is moved (lazy max): 2^8 keeps them far from fp32's limits and spares most blocks a max pass.
constexpr float kFmaLazySum = 256.0f;

// Scratch of one item; column col = h * BQ + r as in prefill_softmax.h, tiles of W columns.
struct FmaScratch {
  float* qt;    // [tiles][d][W] queries * scale, transposed
  float* s;     // [tiles][kFKeys][W] logits of the current key block
  float* p;     // [tiles][kFKeys][W] their probabilities (0 for keys a column does not see)
  float* o;     // [tiles][d][W] unnormalised output, transposed
  float* m;     // [cols] running max
  float* l;     // [cols] running sum
  int32_t* thr;  // [cols] last key index the column sees
};

static int64_t fma_layout(const PrefillArgs& a, float* base, FmaScratch* out) {
  const int64_t cols = a.num_heads / a.num_kv_heads * a.query_block, d = a.head_dim;
  const int64_t sizes[7] = {cols * d, kFKeys * cols, kFKeys * cols, cols * d, cols, cols, cols};
  float* parts[7];
  const int64_t used = carve_scratch(base, sizes, 7, parts);
  if (out != nullptr)
    *out = {parts[0], parts[1], parts[2], parts[3], parts[4], parts[5],
            reinterpret_cast<int32_t*>(parts[6])};
  return used;
}

static int64_t prefill_scratch_fma(const PrefillArgs& a) { return fma_layout(a, nullptr, nullptr); }

// Transposed, scaled queries of the item (zero past nq) and each column's last visible key.
static void fma_pack_queries(const PrefillArgs& a, int64_t kvh, int64_t q0, const FmaScratch& w) {
  const int64_t G = a.num_heads / a.num_kv_heads, BQ = a.query_block, d = a.head_dim;
  const float scale = a.scale;
  for (int64_t h = 0; h < G; ++h)
    for (int64_t r = 0; r < BQ; ++r) {
      const int64_t col = h * BQ + r, row = q0 + r;
      w.thr[col] = (int32_t)(row < a.nq ? a.nk - a.nq + row : a.nk - 1);
      float* dst = w.qt + col / W * d * W + col % W;
      const int64_t at = (kvh * G + h) * a.query_head_stride + row * a.query_row_stride;
      if (row >= a.nq) {
        for (int64_t e = 0; e < d; ++e) dst[e * W] = 0.0f;
      } else if (a.query_f32 != nullptr) {
        for (int64_t e = 0; e < d; ++e) dst[e * W] = a.query_f32[at + e] * scale;
      } else {
        for (int64_t e = 0; e < d; ++e) dst[e * W] = to_float(a.query[at + e]) * scale;
      }
    }
}

// Logits of keys [key, key + kFmaRows) for NC column tiles `t` into w.s.
template <int NC>
static inline void fma_logits(const PrefillArgs& a, const float* K, int64_t key, const int* t,
                              const FmaScratch& w) {
  const int64_t d = a.head_dim;
  vf acc[kFmaRows][NC] = {};
  for (int64_t e = 0; e < d; ++e) {
    vf q[NC];
    for (int c = 0; c < NC; ++c) q[c] = loadu(w.qt + (t[c] * d + e) * W);
    for (int r = 0; r < kFmaRows; ++r) {
      const vf k = splat(K[(key + r) * d + e]);
      for (int c = 0; c < NC; ++c) acc[r][c] += k * q[c];
    }
  }
  for (int r = 0; r < kFmaRows; ++r)
    for (int c = 0; c < NC; ++c) storeu(w.s + (t[c] * kFKeys + key % kFKeys + r) * W, acc[r][c]);
}

// O^T[dims e0 + [0, kFmaRows)] of NC column tiles += values of block k0 times probabilities.
template <int NC>
static inline void fma_values(const PrefillArgs& a, const float* V, int64_t k0, int64_t e0,
                              const int* t, const FmaScratch& w) {
  const int64_t d = a.head_dim;
  vf acc[kFmaRows][NC];
  for (int r = 0; r < kFmaRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = loadu(w.o + (t[c] * d + e0 + r) * W);
  for (int64_t k = 0; k < kFKeys; ++k) {
    vf p[NC];
    for (int c = 0; c < NC; ++c) p[c] = loadu(w.p + (t[c] * kFKeys + k) * W);
    for (int r = 0; r < kFmaRows; ++r) {
      const vf v = splat(V[(k0 + k) * d + e0 + r]);
      for (int c = 0; c < NC; ++c) acc[r][c] += v * p[c];
    }
  }
  for (int r = 0; r < kFmaRows; ++r)
    for (int c = 0; c < NC; ++c) storeu(w.o + (t[c] * d + e0 + r) * W, acc[r][c]);
}

template <int NC>
static void fma_products(bool values, const PrefillArgs& a, const float* K, const float* V,
                         int64_t k0, const int* t, const FmaScratch& w) {
  if (!values) {
    for (int64_t k = 0; k < kFKeys; k += kFmaRows) fma_logits<NC>(a, K, k0 + k, t, w);
  } else {
    for (int64_t e0 = 0; e0 < a.head_dim; e0 += kFmaRows) fma_values<NC>(a, V, k0, e0, t, w);
  }
}

static void fma_products_all(bool values, const PrefillArgs& a, const float* K, const float* V,
                             int64_t k0, const int* tiles, int nt, const FmaScratch& w) {
  for (int i = 0; i < nt;) {
    const int left = nt - i;
    if (left >= 3) {
      fma_products<3>(values, a, K, V, k0, tiles + i, w);
      i += 3;
    } else if (left == 2) {
      fma_products<2>(values, a, K, V, k0, tiles + i, w);
      i += 2;
    } else {
      fma_products<1>(values, a, K, V, k0, tiles + i, w);
      i += 1;
    }
  }
}

// Lanes of the columns that see key k: thr - reach <= k <= thr, as one unsigned compare of
// thr - k against reach (negative differences wrap past it).
static inline vi fma_visible(vi thr, vu reach, int64_t k) {
  return (vi)((vu)(thr - (vi{} + (int32_t)k)) <= reach);
}

static inline bool all_lanes(vi mask) {
  int32_t all = -1;
  for (int i = 0; i < W; ++i) all &= mask[i];
  return all != 0;
}

// p = exp2((s - m) * log2 e) of tile t's block logits into w.p, 0 for keys a column does not
// see (kMasked; their logits may be anything, inf and NaN included); returns the columns' sums.
template <bool kMasked>
static inline vf fma_probabilities(int64_t k0, int t, vf m, vi thr, vu reach,
                                   const FmaScratch& w) {
  const float* s = w.s + t * kFKeys * W;
  float* p = w.p + t * kFKeys * W;
  const vf log2e = splat(kLog2e);
  vf sum0 = {}, sum1 = {};
  for (int64_t k = 0; k < kFKeys; k += 2) {
    vf p0 = vexp2((loadu(s + k * W) - m) * log2e);
    vf p1 = vexp2((loadu(s + (k + 1) * W) - m) * log2e);
    if (kMasked) {
      p0 = (vf)((vi)p0 & fma_visible(thr, reach, k0 + k));
      p1 = (vf)((vi)p1 & fma_visible(thr, reach, k0 + k + 1));
    }
    storeu(p + k * W, p0);
    storeu(p + (k + 1) * W, p1);
    sum0 += p0;
    sum1 += p1;
  }
  return sum0 + sum1;
}

// The columns' max of tile t's block logits over the keys they see (-inf where none; a NaN
// logit is passed over). Four chains: the max's latency, not its throughput, bounds one.
template <bool kMasked>
static inline vf fma_block_max(int64_t k0, int t, vi thr, vu reach, const FmaScratch& w) {
  const float* s = w.s + t * kFKeys * W;
  vf mx[4];
  for (int j = 0; j < 4; ++j) mx[j] = splat(kNegInf);
  for (int64_t k = 0; k < kFKeys; k += 4)
    for (int j = 0; j < 4; ++j) {
      const vf x = loadu(s + (k + j) * W);
      const vi larger = x > mx[j];
      mx[j] = (kMasked ? larger & fma_visible(thr, reach, k0 + k + j) : larger) ? x : mx[j];
    }
  const vf a = mx[0] > mx[1] ? mx[0] : mx[1], b = mx[2] > mx[3] ? mx[2] : mx[3];
  return a > b ? a : b;
}

// Online softmax of tile t over the block's logits into w.p; m and l updated, O^T rescaled
// where the max moved. kMasked: the block crosses the tile's diagonal or its window's lower
// edge. Lazy max: once every column has a max, the block is first exponentiated against it;
// that is kept if no column's sum exceeds kFmaLazySum (m + ln l is the same for any reference
// max; it only has to keep the probabilities in range), else the block is redone against the
// new max.
template <bool kMasked>
static void fma_softmax(const PrefillArgs& a, int64_t k0, int t, int32_t reach,
                        const FmaScratch& w) {
  const vi thr = (vi)loadu(reinterpret_cast<const float*>(w.thr + t * W));
  const vu reach_v = (vu)(vi{} + reach);
  const vf m_old = loadu(w.m + t * W), l = loadu(w.l + t * W);
  if (all_lanes(m_old != splat(kFmaNoMax))) {
    const vf sum = fma_probabilities<kMasked>(k0, t, m_old, thr, reach_v, w);
    if (all_lanes(sum <= splat(kFmaLazySum))) {
      storeu(w.l + t * W, l + sum);
      return;
    }
  }
  const vf mx = fma_block_max<kMasked>(k0, t, thr, reach_v, w);
  const vf m_new = m_old > mx ? m_old : mx;
  const vf alpha = vexp2((m_old - m_new) * splat(kLog2e));
  const vf sum = fma_probabilities<kMasked>(k0, t, m_new, thr, reach_v, w);
  storeu(w.l + t * W, l * alpha + sum);
  storeu(w.m + t * W, m_new);
  if (all_lanes(alpha == splat(1.0f))) return;
  float* o = w.o + t * a.head_dim * W;
  for (int64_t e = 0; e < a.head_dim; ++e) storeu(o + e * W, loadu(o + e * W) * alpha);
}

// out = O / l (fp32, or bf16 rounded to nearest even) and lse = m + ln l of the item's rows.
static void fma_write_rows(const PrefillArgs& a, int64_t kvh, int64_t q0, int64_t rows,
                           const FmaScratch& w) {
  const int64_t G = a.num_heads / a.num_kv_heads, BQ = a.query_block, d = a.head_dim;
  for (int64_t h = 0; h < G; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t col = h * BQ + r, head = kvh * G + h, at = (head * a.nq + q0 + r) * d;
      const float inv = 1.0f / w.l[col];
      const float* o = w.o + col / W * d * W + col % W;
      for (int64_t e = 0; e < d; ++e) {
        if (a.out_f32 != nullptr) {
          a.out_f32[at + e] = o[e * W] * inv;
        } else {
          from_float(o[e * W] * inv, a.out + at + e);
        }
      }
      a.lse[head * a.nq + q0 + r] = w.m[col] + __builtin_logf(w.l[col]);
    }
}

static void prefill_item_fma(const PrefillArgs& a, int64_t kvh, int64_t qb, float* scratch) {
  FmaScratch w;
  fma_layout(a, scratch, &w);
  const int64_t cols = a.num_heads / a.num_kv_heads * a.query_block, ntiles = cols / W;
  const int64_t d = a.head_dim, q0 = qb * a.query_block;
  const int64_t rows = a.nq - q0 < a.query_block ? a.nq - q0 : a.query_block;
  fma_pack_queries(a, kvh, q0, w);
  for (int64_t c = 0; c < cols; ++c) {
    w.m[c] = kFmaNoMax;
    w.l[c] = 0.0f;
  }
  __builtin_memset(w.o, 0, d * cols * sizeof(float));
  const float* K = a.key_f32 + kvh * a.nkp * d;
  const float* V = a.value_f32 + kvh * a.nkp * d;
  const int64_t last_key = a.nk - a.nq + q0 + rows - 1;
  const int32_t reach = a.window > 0 ? (int32_t)(a.window - 1) : (int32_t)(1 << 30);
  const int64_t first_key = a.nk - a.nq + q0 - reach;
  const int64_t first_block = first_key > 0 ? first_key / kFKeys * kFKeys : 0;
  int tiles[4 * 64];
  for (int64_t k0 = first_block; k0 <= last_key; k0 += kFKeys) {
    int nt = 0;
    bool masked[4 * 64];
    for (int t = 0; t < ntiles; ++t) {
      const int64_t low = w.thr[t * W], high = w.thr[t * W + W - 1];
      if (k0 > high || k0 + kFKeys - 1 < low - reach) continue;
      // every column sees every key of the block: none past its diagonal or below its window
      masked[nt] = k0 + kFKeys - 1 > low || k0 < high - reach;
      tiles[nt++] = t;
    }
    fma_products_all(false, a, K, V, k0, tiles, nt, w);
    for (int i = 0; i < nt; ++i) {
      if (masked[i]) {
        fma_softmax<true>(a, k0, tiles[i], reach, w);
      } else {
        fma_softmax<false>(a, k0, tiles[i], reach, w);
      }
    }
    fma_products_all(true, a, K, V, k0, tiles, nt, w);
  }
  fma_write_rows(a, kvh, q0, rows, w);
}
