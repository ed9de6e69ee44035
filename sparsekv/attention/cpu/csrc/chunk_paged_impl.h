// Multi-query paged attention (chunk_paged.h), written once with GCC vector extensions.
//
// Included inside one namespace per ISA unit after vec_impl.h (SKV_W fp32 lanes); the unit's
// `#pragma GCC target` decides the instructions. Every function is static (see kernels.h).
//
// Per item the rows' queries are scaled by scale * log2(e) (base-2 logits, as the decode
// kernel) and kept in the chunk order of the pool's element type (vec_impl.h), so bf16 keys
// need no unpacking shuffle; each key tile then takes three passes: logits (one row against W
// keys, a transposing lane sum), the online-softmax update (Milakov & Gimelshein 2018;
// FlashAttention, Dao et al. 2022) and the weighted value sum (up to four rows per value load).

constexpr int kChunkMaxTile = 32;

// Row pointers of one key tile's keys and values, in the pages or in the chunk; entries past
// the tile's n keys repeat key 0 (their logits are masked).
template <typename T>
struct ChunkTile {
  const T* k[kChunkMaxTile];
  const T* v[kChunkMaxTile];
  int64_t n;
};

template <typename T>
static void chunk_tile_rows(const ChunkArgs& a, const ChunkItem& it, int64_t j0, int64_t j1,
                            int64_t padded, ChunkTile<T>& t) {
  const T* pool = (const T*)a.pool;
  const int64_t nc = a.num_cached[it.b], d = a.head_dim, bs = a.block_size;
  const int64_t kv_plane = a.num_kv_heads * bs * d;  // K -> V of one page
  const int64_t* table = a.block_tables + it.b * a.max_blocks;
  const int64_t first_row = a.row_starts[it.b];
  int64_t j = j0;
  const int64_t paged_end = j1 < nc ? j1 : nc;
  while (j < paged_end) {  // page by page: one division per page, not per key
    const int64_t off = j % bs, count = bs - off < paged_end - j ? bs - off : paged_end - j;
    const T* k = pool + table[j / bs] * 2 * kv_plane + (it.kvh * bs + off) * d;
    for (int64_t i = 0; i < count; ++i) {
      t.k[j - j0 + i] = k + i * d;
      t.v[j - j0 + i] = k + i * d + kv_plane;
    }
    j += count;
  }
  for (; j < j1; ++j) {
    const int64_t row = first_row + j - nc;
    t.k[j - j0] = (const T*)a.key + it.kvh * a.key_head_stride + row * a.key_row_stride;
    t.v[j - j0] = (const T*)a.value + it.kvh * a.value_head_stride + row * a.value_row_stride;
  }
  t.n = j1 - j0;
  for (int64_t i = t.n; i < padded; ++i) {
    t.k[i] = t.k[0];
    t.v[i] = t.v[0];
  }
}

// Queries of the item's rows (row r: head kvh * group + r / num_rows, chunk row r % num_rows)
// into q [rows][head_dim], scaled to base-2 logits, in T's chunk order; states reset.
template <typename T>
static void chunk_load_queries(const ChunkArgs& a, const ChunkItem& it, float* q, float* st) {
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t rows = group * it.num_rows, first_row = a.row_starts[it.b] + it.row0;
  const float qscale = a.scale * kLog2e;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = it.kvh * group + r / it.num_rows, row = first_row + r % it.num_rows;
    const int64_t off = h * a.query_head_stride + row * a.query_row_stride;
    float* qr = q + r * d;
    for (int64_t e = 0; e < d; ++e) {
      const float x = a.query_bf16 ? to_float(((const uint16_t*)a.query)[off + e])
                                   : ((const float*)a.query)[off + e];
      qr[chunk_pos<T>(e)] = x * qscale;
    }
    float* s = st + r * (d + 2);
    s[0] = kNegInf;
    for (int64_t e = 1; e < d + 2; ++e) s[e] = 0.0f;
  }
}

// Base-2 logits s [rows][tile] of every row against the tile's `padded` keys.
template <typename T>
static void chunk_logits(const ChunkTile<T>& t, const float* q, int64_t rows, int64_t d,
                         int64_t padded, int64_t tile, float* s) {
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
      storeu(s + r * tile + kb, reduce_lanes(acc));
    }
  }
}

// Mask the logits each row does not see, turn them into weights exp2(s - new max) in place
// and rescale the row's state; a row that sees no key of the tile gets zero weights.
static void chunk_softmax(const ChunkArgs& a, const ChunkItem& it, int64_t j0, int64_t n,
                          int64_t padded, int64_t tile, float* s, float* st) {
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t rows = group * it.num_rows, nc = a.num_cached[it.b];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = nc + it.row0 + r % it.num_rows;
    const int64_t lo = a.window > 0 ? pos - a.window + 1 : 0;
    float* sr = s + r * tile;
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
static void chunk_values(const ChunkTile<T>& t, const float* p, int64_t tile, float* st,
                         int64_t d) {
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
        const vf w = splat(p[r * tile + k]);
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

template <typename T>
static void chunk_item_t(const ChunkArgs& a, const ChunkItem& it, float* scratch,
                         float* states) {
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads, tile = a.tile;
  const int64_t rows = group * it.num_rows;
  float* q = scratch;
  float* s = q + rows * d;
  float* st = states + it.state;
  chunk_load_queries<T>(a, it, q, st);
  const int64_t last = a.num_cached[it.b] + it.row0 + it.num_rows;  // keys seen: < last
  ChunkTile<T> t;
  for (int64_t ti = it.tile_begin; ti < it.tile_end; ++ti) {
    const int64_t j0 = ti * tile, j1 = j0 + tile < last ? j0 + tile : last;
    if (j1 <= j0) continue;
    const int64_t padded = (j1 - j0 + W - 1) / W * W;
    chunk_tile_rows<T>(a, it, j0, j1, padded, t);
    chunk_logits<T>(t, q, rows, d, padded, tile, s);
    chunk_softmax(a, it, j0, t.n, padded, tile, s, st);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) chunk_values<4>(t, s + r * tile, tile, st + r * (d + 2), d);
    for (; r < rows; ++r) chunk_values<1>(t, s + r * tile, tile, st + r * (d + 2), d);
  }
}

static int64_t chunk_scratch(const ChunkArgs& a, int64_t rows) {
  return rows * (a.head_dim + a.tile);
}

static void chunk_item(const ChunkArgs& a, const ChunkItem& it, float* scratch, float* states) {
  if (a.pool_bf16)
    chunk_item_t<uint16_t>(a, it, scratch, states);
  else
    chunk_item_t<float>(a, it, scratch, states);
}

template <typename T>
static void chunk_combine_t(const ChunkArgs& a, const ChunkItem* items, int64_t count,
                            const float* states) {
  const ChunkItem& it = items[0];
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t rows = group * it.num_rows, first_row = a.row_starts[it.b] + it.row0;
  float acc[1024];  // head_dim <= 1024 (checked by the binding)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = it.kvh * group + r / it.num_rows, row = first_row + r % it.num_rows;
    float m = kNegInf;
    for (int64_t i = 0; i < count; ++i) {
      const float mi = states[items[i].state + r * (d + 2)];
      m = mi > m ? mi : m;
    }
    float l = 0.0f;
    for (int64_t e = 0; e < d; ++e) acc[e] = 0.0f;
    for (int64_t i = 0; i < count && m != kNegInf; ++i) {
      const float* st = states + items[i].state + r * (d + 2);
      if (st[0] == kNegInf) continue;
      const float w = vexp2(splat(st[0] - m))[0];
      l += w * st[1];
      for (int64_t e = 0; e < d; e += W) storeu(acc + e, loadu(acc + e) + splat(w) * loadu(st + 2 + e));
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int64_t o = (h * a.total_rows + row) * d;
    for (int64_t e = 0; e < d; ++e) {
      const float x = acc[chunk_pos<T>(e)] * inv;
      if (a.query_bf16)
        from_float(x, (uint16_t*)a.out + o + e);
      else
        ((float*)a.out)[o + e] = x;
    }
    a.lse[h * a.total_rows + row] = l > 0.0f ? (m + __builtin_log2f(l)) * kLn2 : kNegInf;
  }
}

static void chunk_combine(const ChunkArgs& a, const ChunkItem* items, int64_t count,
                          const float* states) {
  if (a.pool_bf16)
    chunk_combine_t<uint16_t>(a, items, count, states);
  else
    chunk_combine_t<float>(a, items, count, states);
}
