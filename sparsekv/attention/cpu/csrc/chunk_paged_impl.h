// Multi-query paged attention (chunk_paged.h), written once with GCC vector extensions.
//
// Included inside one namespace per ISA unit after vec_impl.h (SKV_W fp32 lanes); the unit's
// `#pragma GCC target` decides the instructions. Every function is static (see kernels.h).
//
// Per item the rows' queries are scaled by scale * log2(e) (base-2 logits, as the decode
// kernel); each key tile then takes three passes: logits, the online-softmax update (Milakov &
// Gimelshein 2018; FlashAttention, Dao et al. 2022) and the weighted value sum, with the item's
// rows in vector lanes (below).

constexpr int kChunkMaxTile = 32;
static_assert(kChunkTileKeys <= kChunkMaxTile && kChunkTileKeys % W == 0, "tile of whole vectors");
static_assert(kChunkTileKeysBf16 <= kChunkMaxTile && kChunkTileKeysBf16 % W == 0, "whole vectors");

static inline int64_t chunk_min(int64_t x, int64_t y) { return x < y ? x : y; }

// Row pointers of one key tile's keys and values, in the pages or in the chunk. chunk_tile_rows
// fills entries n .. padded - 1 with key 0's rows: the narrow path reads whole vectors of keys
// and masks those logits.
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

// Rows lie in vector lanes: an item's rows (row r: head kvh * group + r / num_rows, chunk row
// r % num_rows) are padded to rp = ceil(rows / W) * W lanes, so logits, the online softmax and
// the output accumulators are W rows wide and need no horizontal reduction. Each key or value
// element is broadcast against a vector of rows: QK^T and PV each cost keys * head_dim * rp / W
// FMAs with several independent accumulators (a register block of keys or of head_dim
// elements times up to four row vectors), and a bf16 tile is widened to fp32 once for all its
// rows. Item state (chunk_state_floats): max [rp], sum [rp], accumulator [head_dim][rp], head_dim
// in T's chunk order.

static inline int64_t chunk_lanes(int64_t rows) { return (rows + W - 1) / W * W; }

// Queries of the item's rows scaled to base-2 logits: element e of row r (head kvh * group +
// r / num_rows, chunk row r % num_rows) to q[r * row_stride + chunk_pos<T>(e) * elem_stride].
template <typename T>
static void chunk_scaled_queries(const ChunkArgs& a, const ChunkItem& it, float* q,
                                 int64_t row_stride, int64_t elem_stride) {
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t rows = group * it.num_rows, first_row = a.row_starts[it.b] + it.row0;
  const float qscale = a.scale * kLog2e;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = it.kvh * group + r / it.num_rows, row = first_row + r % it.num_rows;
    const int64_t off = h * a.query_head_stride + row * a.query_row_stride;
    for (int64_t e = 0; e < d; ++e) {
      const float x = a.query_bf16 ? to_float(((const uint16_t*)a.query)[off + e])
                                   : ((const float*)a.query)[off + e];
      q[r * row_stride + chunk_pos<T>(e) * elem_stride] = x * qscale;
    }
  }
}

// An item's state before its first key: max -inf, sum and accumulator 0 (rp lanes).
static inline void chunk_reset_state(int64_t rp, int64_t d, float* st) {
  for (int64_t r = 0; r < rp; ++r) st[r] = kNegInf;
  for (int64_t i = rp; i < (d + 2) * rp; ++i) st[i] = 0.0f;
}

// Queries transposed into qt [head_dim][rp] (padding lanes 0); states reset.
template <typename T>
static void chunk_load_queries(const ChunkArgs& a, const ChunkItem& it, int64_t rp, float* qt,
                               float* st) {
  const int64_t d = a.head_dim;
  for (int64_t i = 0; i < d * rp; ++i) qt[i] = 0.0f;
  chunk_scaled_queries<T>(a, it, qt, 1, rp);
  chunk_reset_state(rp, d, st);
}

#include "chunk_paged_prefetch.h"

// The tile's keys and values as fp32 rows of stride head_dim: an fp32 tile whose rows already
// follow each other (a whole page run) is read in place, any other is copied (bf16: widened, in
// chunk order) into buf [2][tile][head_dim]. Sets *k and *v to the first rows.
template <typename T>
static void chunk_stage(const ChunkTile<T>& t, int64_t d, int64_t tile, float* buf,
                        const float** k, const float** v) {
  if (sizeof(T) == 4) {
    bool runs = true;
    for (int64_t i = 1; i < t.n && runs; ++i)
      runs = t.k[i] == t.k[0] + i * d && t.v[i] == t.v[0] + i * d;
    if (runs) {
      *k = (const float*)t.k[0];
      *v = (const float*)t.v[0];
      return;
    }
  }
  float* kf = buf;
  float* vf_ = buf + tile * d;
  for (int64_t i = 0; i < t.n; ++i)
    for (int64_t c = 0; c < d; c += 2 * W) {
      vf x0, x1;
      load_chunk(t.k[i], c, x0, x1);
      storeu(kf + i * d + c, x0);
      storeu(kf + i * d + c + W, x1);
      load_chunk(t.v[i], c, x0, x1);
      storeu(vf_ + i * d + c, x0);
      storeu(vf_ + i * d + c + W, x1);
    }
  *k = kf;
  *v = vf_;
}

// head_dim: D when the kernel was instantiated for it (immediate offsets), else the runtime d.
template <int D>
static inline int64_t chunk_dim(int64_t d) {
  return D > 0 ? D : d;
}

// s[k][R vectors] = logits of keys k[0..KB) (rows of stride head_dim) against R row vectors
// of qt (row stride rp).
template <int D, int R, int KB>
static inline void chunk_qk_block(const float* k, const float* qt, int64_t rp, int64_t d_,
                                  float* s) {
  const int64_t d = chunk_dim<D>(d_);
  vf acc[KB][R];
  for (int j = 0; j < KB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = vf{};
  for (int64_t p = 0; p < d; ++p) {
    vf q[R];
    for (int r = 0; r < R; ++r) q[r] = loadu(qt + p * rp + r * W);
    for (int j = 0; j < KB; ++j) {
      const vf x = splat(k[j * d + p]);
      for (int r = 0; r < R; ++r) acc[j][r] += x * q[r];
    }
  }
  for (int j = 0; j < KB; ++j)
    for (int r = 0; r < R; ++r) storeu(s + j * rp + r * W, acc[j][r]);
}

template <int D, int R>
static void chunk_qk(const float* k, int64_t n, const float* qt, int64_t rp, int64_t d,
                     float* s, ChunkLines& lines) {
  constexpr int KB = (W == 16 ? 24 : 12) / R < 8 ? (W == 16 ? 24 : 12) / R : 8;
  int64_t j = 0;
  for (; j + KB <= n; j += KB) {
    chunk_qk_block<D, R, KB>(k + j * d, qt, rp, d, s + j * rp);
    lines.step();
  }
  for (; j < n; ++j) chunk_qk_block<D, R, 1>(k + j * d, qt, rp, d, s + j * rp);
}

// acc[e][R vectors] = alpha * acc + sum_k p[k] * v[k][e] for EB elements from e0 (v: rows of
// stride head_dim).
template <int D, int R, int EB>
static inline void chunk_pv_block(const float* v, int64_t n, const float* p, const float* alpha,
                                  int64_t rp, int64_t d_, int64_t e0, float* acc) {
  const int64_t d = chunk_dim<D>(d_);
  vf o[EB][R], al[R];
  for (int r = 0; r < R; ++r) al[r] = loadu(alpha + r * W);
  for (int e = 0; e < EB; ++e)
    for (int r = 0; r < R; ++r) o[e][r] = loadu(acc + (e0 + e) * rp + r * W) * al[r];
  for (int64_t j = 0; j < n; ++j) {
    vf w[R];
    for (int r = 0; r < R; ++r) w[r] = loadu(p + j * rp + r * W);
    const float* vj = v + j * d + e0;
    for (int e = 0; e < EB; ++e) {
      const vf x = splat(vj[e]);
      for (int r = 0; r < R; ++r) o[e][r] += x * w[r];
    }
  }
  for (int e = 0; e < EB; ++e)
    for (int r = 0; r < R; ++r) storeu(acc + (e0 + e) * rp + r * W, o[e][r]);
}

template <int D, int R>
static void chunk_pv(const float* v, int64_t n, const float* p, const float* alpha, int64_t rp,
                     int64_t d, float* acc, ChunkLines& lines) {
  // head_dim is a multiple of 2W (>= 8), so of every EB below
  constexpr int EB = W == 16 ? (R == 1 ? 16 : R <= 3 ? 8 : 4) : (R == 1 ? 8 : R <= 3 ? 4 : 2);
  for (int64_t e0 = 0; e0 < d; e0 += EB) {
    chunk_pv_block<D, R, EB>(v, n, p, alpha, rp, d, e0, acc);
    lines.step();
  }
}

// Online-softmax step of the tile's logits s [n][rp] (keys j0..j0+n): masks what each row does
// not see, turns logits into weights exp2(s - new max) in place, updates max and sum and leaves
// each row's rescale factor of its accumulator in alpha [rp].
static void chunk_softmax(const ChunkArgs& a, const ChunkItem& it, int64_t rows, int64_t rp,
                          int64_t j0, int64_t n, float* s, float* st, float* alpha) {
  const int64_t nc = a.num_cached[it.b];
  const int64_t pos_first = nc + it.row0, pos_last = pos_first + it.num_rows - 1;
  const bool sees_all = j0 + n - 1 <= pos_first && (a.window <= 0 || j0 > pos_last - a.window);
  if (!sees_all)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = pos_first + r % it.num_rows;
      const int64_t lo = a.window > 0 ? pos - a.window + 1 : 0;
      for (int64_t k = 0; k < n; ++k)
        if (j0 + k > pos || j0 + k < lo) s[k * rp + r] = kNegInf;
    }
  for (int64_t c = 0; c < rp; c += W) {
    vf mt = splat(kNegInf);
    for (int64_t k = 0; k < n; ++k) mt = vmax(mt, loadu(s + k * rp + c));
    const vf m_old = loadu(st + c), m_new = vmax(m_old, mt);
    const vf m_use = m_new == splat(kNegInf) ? vf{} : m_new;  // no -inf - -inf
    vf sum = vf{};
    for (int64_t k = 0; k < n; ++k) {
      const vf w = vexp2(loadu(s + k * rp + c) - m_use);
      storeu(s + k * rp + c, w);
      sum += w;
    }
    const vf al = vexp2(m_old - m_use);  // 0 while nothing was seen (m_old = -inf)
    storeu(alpha + c, al);
    storeu(st + c, m_new);
    storeu(st + rp + c, loadu(st + rp + c) * al + sum);
  }
}

// Row vectors of the pass that starts at lane c of rp: runs of at most four.
static inline int chunk_pass_vectors(int64_t rp, int64_t c) {
  return (int)chunk_min((rp - c) / W, 4);
}

// Runs CALL(R) for each run of at most four row vectors (c: the run's first lane).
#define SKV_CHUNK_ROW_PASSES(rp, CALL)           \
  for (int64_t c = 0; c < (rp); c += 4 * W) {    \
    switch (chunk_pass_vectors((rp), c)) {       \
      case 1: CALL(1); break;                    \
      case 2: CALL(2); break;                    \
      case 3: CALL(3); break;                    \
      default: CALL(4); break;                   \
    }                                            \
  }

// Runs body(j0, tile, ahead) over the item's key tiles that hold a key its rows see, in order:
// `tile` holds the key rows of keys j0 .. j0 + tile.n - 1 (with `even`, an odd count is padded
// by one entry repeating key 0's rows), `ahead` the prefetch set of the next tile, whose
// step() the body spreads over its `steps` register blocks and finish()es. Two tiles ahead the
// first line of each page run is touched (chunk_paged_prefetch.h).
template <typename T, typename Body>
static void chunk_each_tile(const ChunkArgs& a, const ChunkItem& it, bool even, int64_t steps,
                            Body&& body) {
  const int64_t tile = a.tile, d = a.head_dim;
  const int64_t last = a.num_cached[it.b] + it.row0 + it.num_rows;  // keys seen: < last
  ChunkTile<T> tiles[3];  // tile ti in tiles[ti % 3]: the current one and the two ahead
  ChunkLines lines[3];
  int64_t end = it.tile_end;
  while (end > it.tile_begin && (end - 1) * tile >= last) --end;
  auto gather = [&](int64_t ti) {
    const int64_t j0 = ti * tile, j1 = chunk_min(j0 + tile, last);
    chunk_tile_rows<T>(a, it, j0, j1, even ? (j1 - j0 + 1) / 2 * 2 : 0, tiles[ti % 3]);
    lines[ti % 3].start(tiles[ti % 3], d, steps);
  };
  for (int64_t ti = it.tile_begin; ti < end && ti < it.tile_begin + 2; ++ti) {
    gather(ti);
    lines[ti % 3].touch();
  }
  if (it.tile_begin < end) lines[it.tile_begin % 3].finish();
  for (int64_t ti = it.tile_begin; ti < end; ++ti) {
    if (ti + 2 < end) {
      gather(ti + 2);
      lines[(ti + 2) % 3].touch();
    }
    // after the last tile: a set already finished (or never started), whose steps do nothing
    ChunkLines& ahead = lines[(ti + 1) % 3];
    body(ti * tile, tiles[ti % 3], ahead);
    ahead.finish();
  }
}

template <typename T, int D>
static void chunk_item_t(const ChunkArgs& a, const ChunkItem& it, float* scratch,
                         float* states) {
  const int64_t d = chunk_dim<D>(a.head_dim), group = a.num_heads / a.num_kv_heads;
  const int64_t tile = a.tile, rows = group * it.num_rows, rp = chunk_lanes(rows);
  float* qt = scratch;            // [d][rp]
  float* s = qt + d * rp;         // [tile][rp]
  float* alpha = s + tile * rp;   // [rp]
  float* wide = alpha + rp;       // [2][tile][d]
  float* st = states + it.state;  // max [rp], sum [rp], acc [d][rp]
  chunk_load_queries<T>(a, it, rp, qt, st);
  // register blocks per tile: the step() calls that spread the next tile's prefetches
  const int64_t rvecs = rp / W, passes = (rvecs + 3) / 4;
  const int64_t steps = passes * (tile / 8 + d / 16);
  chunk_each_tile<T>(a, it, false, steps,
                     [&](int64_t j0, const ChunkTile<T>& t, ChunkLines& ahead) {
    const int64_t n = t.n;
    const float *k, *v;
    chunk_stage(t, d, tile, wide, &k, &v);
#define SKV_QK(R) chunk_qk<D, R>(k, n, qt + c, rp, d, s + c, ahead)
    SKV_CHUNK_ROW_PASSES(rp, SKV_QK)
#undef SKV_QK
    chunk_softmax(a, it, rows, rp, j0, n, s, st, alpha);
#define SKV_PV(R) chunk_pv<D, R>(v, n, s + c, alpha + c, rp, d, st + 2 * rp + c, ahead)
    SKV_CHUNK_ROW_PASSES(rp, SKV_PV)
#undef SKV_PV
  });
}

#include "chunk_paged_narrow.h"
#if defined(SKV_CHUNK_BF16)
#include "chunk_paged_bf16.h"
#endif
#if defined(SKV_CHUNK_AMX)
#include "amx_tile_config.h"
#include "lazy_softmax.h"
#include "chunk_paged_amx.h"
#endif
#undef SKV_CHUNK_ROW_PASSES

// Rows per item up to which the keys go in lanes (chunk_narrow) rather than the rows: measured
// on Zen 4 (7.7k held slots, group 3, 1 thread), with 16 lanes 3 rows take 0.6 ms that way
// against 2.0 in lanes, 6 rows 0.9-1.1 against 1.6-1.8, 15 rows 2.0 against 1.7; with 8 lanes
// the two meet at about 4 rows.
constexpr int64_t kNarrowRows = W / 2;

static int64_t chunk_scratch(const ChunkArgs& a, int64_t rows) {
  const int64_t rp = chunk_lanes(rows);
  const int64_t lanes = rp * (a.head_dim + a.tile + 1) + 2 * a.tile * a.head_dim;
  const int64_t narrow = narrow_scratch(a, rows);
  int64_t most = narrow > lanes ? narrow : lanes;
#if defined(SKV_CHUNK_BF16)
  most = bf16_scratch(a, rows) > most ? bf16_scratch(a, rows) : most;
#endif
#if defined(SKV_CHUNK_AMX)
  most = amx_chunk_scratch(a, rows) > most ? amx_chunk_scratch(a, rows) : most;
#endif
  return most;
}

template <typename T>
static void chunk_item_dim(const ChunkArgs& a, const ChunkItem& it, float* scratch,
                           float* states) {
  if (a.head_dim == 64)
    chunk_item_t<T, 64>(a, it, scratch, states);
  else if (a.head_dim == 128)
    chunk_item_t<T, 128>(a, it, scratch, states);
  else
    chunk_item_t<T, 0>(a, it, scratch, states);
}

static void chunk_item(const ChunkArgs& a, const ChunkItem& it, float* scratch, float* states) {
  const int64_t rows = a.num_heads / a.num_kv_heads * it.num_rows;
#if defined(SKV_CHUNK_AMX)
  if (a.pool_bf16 && rows <= kAmxChunkCols) {
    chunk_item_amx(a, it, scratch, states);
    return;
  }
#endif
  if (rows <= kNarrowRows) {
    if (a.pool_bf16)
      chunk_narrow<uint16_t>(a, it, scratch, states);
    else
      chunk_narrow<float>(a, it, scratch, states);
    return;
  }
#if defined(SKV_CHUNK_BF16)
  if (a.pool_bf16) {
    chunk_item_bf16(a, it, scratch, states);
    return;
  }
#endif
  if (a.pool_bf16)
    chunk_item_dim<uint16_t>(a, it, scratch, states);
  else
    chunk_item_dim<float>(a, it, scratch, states);
}

template <typename T>
static void chunk_combine_t(const ChunkArgs& a, const ChunkItem* items, int64_t count,
                            const float* states) {
  const ChunkItem& it = items[0];
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t rows = group * it.num_rows, rp = chunk_lanes(rows);
  const int64_t first_row = a.row_starts[it.b] + it.row0;
  float acc[1024];  // head_dim <= 1024 (checked by the binding)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = it.kvh * group + r / it.num_rows, row = first_row + r % it.num_rows;
    float m = kNegInf;
    for (int64_t i = 0; i < count; ++i) {
      const float mi = states[items[i].state + r];
      m = mi > m ? mi : m;
    }
    float l = 0.0f;
    for (int64_t e = 0; e < d; ++e) acc[e] = 0.0f;
    for (int64_t i = 0; i < count && m != kNegInf; ++i) {
      const float* st = states + items[i].state;
      if (st[r] == kNegInf) continue;
      const float w = vexp2(splat(st[r] - m))[0];
      l += w * st[rp + r];
      for (int64_t e = 0; e < d; ++e) acc[e] += w * st[(2 + e) * rp + r];
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
