// Items of few rows (chunk_paged_impl.h, chunk_narrow): keys in vector lanes instead of rows.
//
// With the rows in lanes an item pays a full vector per key whatever its row count, so the
// three rows of a one-row chunk (a group of three query heads) would fill 3 of 16 lanes. Here
// each row meets W keys at a time: one row against W keys, the W partial sums reduced into one
// vector of logits by a transposing lane sum (reduce_lanes), the online softmax per row and the
// weighted value sum for up to four rows per value load. Included by chunk_paged_impl.h; the
// item's state ends in the lanes layout chunk_combine reads.

constexpr int kNarrowTile = 32;  // keys per step: a multiple of every variant's width
static_assert(kNarrowTile <= kChunkMaxTile && kNarrowTile % W == 0, "tile of whole vectors");

// Queries of the item's rows into q [rows][head_dim] (chunk_scaled_queries); per-row states
// st [rows][head_dim + 2] (max, sum, accumulator) reset.
template <typename T>
static void narrow_load_queries(const ChunkArgs& a, const ChunkItem& it, float* q, float* st) {
  const int64_t d = a.head_dim, rows = a.num_heads / a.num_kv_heads * it.num_rows;
  chunk_scaled_queries<T>(a, it, q, d, 1);
  for (int64_t r = 0; r < rows; ++r) {
    float* s = st + r * (d + 2);
    s[0] = kNegInf;
    for (int64_t e = 1; e < d + 2; ++e) s[e] = 0.0f;
  }
}

// Base-2 logits s [rows][kNarrowTile] of every row against the tile's `padded` keys.
template <typename T>
static void narrow_logits(const ChunkTile<T>& t, const float* q, int64_t rows, int64_t d,
                          int64_t padded, float* s) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + r * d;
    for (int64_t kb = 0; kb < padded; kb += W) {
      vf acc[W];
      for (int k = 0; k < W; ++k) acc[k] = vf{};
      for (int64_t c = 0; c < d; c += 2 * W) {
        const vf qa = loadu(qr + c), qb = loadu(qr + c + W);
        for (int k = 0; k < W; ++k) {
          vf ka, kb2;
          load_chunk(t.k[kb + k], c, ka, kb2);
          acc[k] += qa * ka + qb * kb2;
        }
      }
      storeu(s + r * kNarrowTile + kb, reduce_lanes(acc));
    }
  }
}

// Masks the logits each row does not see, turns them into weights exp2(s - new max) in place
// and rescales the row's state; a row that sees no key of the tile gets zero weights.
static void narrow_softmax(const ChunkArgs& a, const ChunkItem& it, int64_t j0, int64_t n,
                           int64_t padded, float* s, float* st) {
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t rows = group * it.num_rows, nc = a.num_cached[it.b];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = nc + it.row0 + r % it.num_rows;
    const int64_t lo = a.window > 0 ? pos - a.window + 1 : 0;
    float* sr = s + r * kNarrowTile;
    float mt = kNegInf;
    if (n == padded && j0 >= lo && j0 + n - 1 <= pos) {  // the row sees the whole tile
      vf mv = splat(kNegInf);
      for (int64_t k = 0; k < padded; k += W) mv = vmax(mv, loadu(sr + k));
      mt = hmax(mv);
    } else {
      for (int64_t k = 0; k < padded; ++k) {
        const int64_t j = j0 + k;
        if (k >= n || j > pos || j < lo)
          sr[k] = kNegInf;
        else
          mt = sr[k] > mt ? sr[k] : mt;
      }
    }
    if (mt == kNegInf) {
      for (int64_t k = 0; k < padded; ++k) sr[k] = 0.0f;
      continue;
    }
    float* str = st + r * (d + 2);
    const float m_old = str[0], m_new = m_old > mt ? m_old : mt;
    vf sum = vf{};
    for (int64_t k = 0; k < padded; k += W) {
      const vf p = vexp2(loadu(sr + k) - splat(m_new));
      storeu(sr + k, p);
      sum += p;
    }
    float alpha = 1.0f;
    if (m_old != m_new) {
      alpha = m_old == kNegInf ? 0.0f : vexp2(splat(m_old - m_new))[0];
      for (int64_t e = 0; e < d; e += W) storeu(str + 2 + e, loadu(str + 2 + e) * splat(alpha));
    }
    str[0] = m_new;
    str[1] = str[1] * alpha + hsum(sum);
  }
}

// acc[r] += sum_k p[r][k] * v[k] for N rows at once (one load of each value chunk).
template <int N, typename T>
static void narrow_values(const ChunkTile<T>& t, const float* p, float* st, int64_t d) {
  const int64_t stride = d + 2;
  for (int64_t c = 0; c < d; c += 2 * W) {
    vf a0[N], a1[N];
    for (int r = 0; r < N; ++r) {
      a0[r] = loadu(st + r * stride + 2 + c);
      a1[r] = loadu(st + r * stride + 2 + c + W);
    }
    for (int64_t k = 0; k < t.n; ++k) {
      vf v0, v1;
      load_chunk(t.v[k], c, v0, v1);
      for (int r = 0; r < N; ++r) {
        const vf w = splat(p[r * kNarrowTile + k]);
        a0[r] += w * v0;
        a1[r] += w * v1;
      }
    }
    for (int r = 0; r < N; ++r) {
      storeu(st + r * stride + 2 + c, a0[r]);
      storeu(st + r * stride + 2 + c + W, a1[r]);
    }
  }
}

// Scratch floats of an item of `rows` rows on this path.
static int64_t narrow_scratch(const ChunkArgs& a, int64_t rows) {
  return rows * (a.head_dim + kNarrowTile) + rows * (a.head_dim + 2);
}

// The item's keys [tile_begin * tile, min(tile_end * tile, last)) in steps of kNarrowTile;
// its state is moved to the lanes layout (chunk_item_t) at the end.
template <typename T>
static void chunk_narrow(const ChunkArgs& a, const ChunkItem& it, float* scratch,
                         float* states) {
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t rows = group * it.num_rows, rp = chunk_lanes(rows);
  float* q = scratch;                     // [rows][d]
  float* s = q + rows * d;                // [rows][kNarrowTile]
  float* st = s + rows * kNarrowTile;     // [rows][d + 2]
  narrow_load_queries<T>(a, it, q, st);
  const int64_t last = a.num_cached[it.b] + it.row0 + it.num_rows;  // keys seen: < last
  const int64_t end = chunk_min(it.tile_end * a.tile, last);
  ChunkTile<T> t;
  for (int64_t j0 = it.tile_begin * a.tile; j0 < end; j0 += kNarrowTile) {
    const int64_t j1 = chunk_min(j0 + kNarrowTile, end);
    const int64_t padded = (j1 - j0 + W - 1) / W * W;
    chunk_tile_rows<T>(a, it, j0, j1, padded, t);
    narrow_logits<T>(t, q, rows, d, padded, s);
    narrow_softmax(a, it, j0, t.n, padded, s, st);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) narrow_values<4>(t, s + r * kNarrowTile, st + r * (d + 2), d);
    for (; r < rows; ++r) narrow_values<1>(t, s + r * kNarrowTile, st + r * (d + 2), d);
  }
  float* out = states + it.state;  // max [rp], sum [rp], acc [d][rp]
  for (int64_t r = 0; r < rp; ++r) {
    const float* sr = st + r * (d + 2);
    out[r] = r < rows ? sr[0] : kNegInf;
    out[rp + r] = r < rows ? sr[1] : 0.0f;
    for (int64_t e = 0; e < d; ++e) out[(2 + e) * rp + r] = r < rows ? sr[2 + e] : 0.0f;
  }
}
