// Fused window scores and log-sum-exps on AMX tiles (included by isa_avx512_amx.cpp after
// window_amx.h; interface and semantics in window_fused.h).
//
// One item is one KV head: its group x w window rows (rows r = h * w + i, padded to whole
// 16-row blocks) against all n keys.
// 1. The rows' queries are packed into element pairs once (the B operand), then every block of
//    16 keys (its key tiles loaded once up to head_dim 128) gives C^T[16 keys][16 rows] per row
//    block, as window_amx.h computes it, stored to a logits buffer L[keys][rows] (n x rows
//    fp32: 400 KB for 1040 keys x 96 rows, L2-resident). While a block is in L1, each row's max
//    over the keys it sees is updated (unless the LSE is given).
// 2. Down the keys, four row blocks (16 rows per vector) at a time: one exp2 per logit written
//    back over it with the row sums alongside (or, with the LSE given, exp2(logit - lse) at
//    once).
// 3. Per block of 16 keys and head: the head's row vectors times 1 / sum, accumulated per key
//    and reduced 16 keys at once (reduce_lanes).
// Logits are exact bf16 products summed in fp32, as in every other kernel here. Every pass keeps
// the per-row order of its sums, so the traversal order changes no result bit (S1's 28-layer
// SmolLM2 compaction, 84 heads x 1040 keys x 96 rows, one thread: ~3.6 ms).

static int64_t window_fused_scratch_amx(const WindowFusedArgs& a) {
  return 32 + a.rows * a.head_dim / 2 + a.num_blocks * 16 * a.rows + 8 * a.head_dim +
         4 * a.rows + 64;
}

// Query element pairs of KV head kvh's rows: qp[(rb * chunks + ch) * 256 + p * 16 + c] holds
// elements 2p, 2p + 1 of chunk ch of row rb * 16 + c (zero for padding rows).
static void window_fused_pack_queries(const WindowFusedArgs& a, int64_t kvh, uint32_t* qp) {
  const int64_t chunks = a.head_dim / kAmxChunk, used = a.group * a.w;
  for (int64_t rb = 0; rb < a.rows / 16; ++rb)
    for (int64_t c = 0; c < 16; ++c) {
      const int64_t row = rb * 16 + c;
      const uint16_t* q = nullptr;
      if (row < used)
        q = a.query + (kvh * a.group + row / a.w) * a.query_head_stride +
            (row % a.w) * a.query_row_stride;
      for (int64_t ch = 0; ch < chunks; ++ch)
        for (int64_t p = 0; p < 16; ++p) {
          uint32_t pair = 0;
          if (q != nullptr) {
            const uint16_t* e = q + ch * kAmxChunk + 2 * p;
            pair = (uint32_t)e[0] | ((uint32_t)e[1] << 16);
          }
          qp[(rb * chunks + ch) * 256 + p * 16 + c] = pair;
        }
    }
}

// Key tiles 4 .. 3 + count of chunks ch0 .. ch0 + count - 1 (count <= 4) of 16 key rows.
static inline void window_fused_load_keys(const uint16_t* K, int64_t stride, int64_t ch0,
                                          int64_t count) {
  const uint16_t* k = K + ch0 * kAmxChunk;
  _tile_loadd(4, k, stride * 2);
  if (count > 1) _tile_loadd(5, k + kAmxChunk, stride * 2);
  if (count > 2) _tile_loadd(6, k + 2 * kAmxChunk, stride * 2);
  if (count > 3) _tile_loadd(7, k + 3 * kAmxChunk, stride * 2);
}

// Tile 0 += key tiles 4 .. 3 + count times the query pairs q (one 256-word tile per chunk),
// in chunk order.
static inline void window_fused_dot(const uint32_t* q, int64_t count) {
  _tile_loadd(2, q, 64);
  _tile_dpbf16ps(0, 4, 2);
  if (count > 1) {
    _tile_loadd(3, q + 256, 64);
    _tile_dpbf16ps(0, 5, 3);
  }
  if (count > 2) {
    _tile_loadd(2, q + 512, 64);
    _tile_dpbf16ps(0, 6, 2);
  }
  if (count > 3) {
    _tile_loadd(3, q + 768, 64);
    _tile_dpbf16ps(0, 7, 3);
  }
}

// Folds block b's logits into each row's max over the keys it sees (row r sees key j iff
// j <= thr[r]; padding rows, thr = -1, may take any value: their shift is overridden).
static void window_fused_block_max(const WindowFusedArgs& a, int64_t b, const float* L,
                                   const float* thr, float* mx) {
  const int64_t R = a.rows;
  const bool all_seen = b * 16 + 15 <= a.n - a.w;  // the first window row sees slot n - w
  for (int64_t rb = 0; rb < R / 16; ++rb) {
    const vf last = loadu(thr + rb * 16);
    vf v[16];
    for (int i = 0; i < 16; ++i) {
      v[i] = loadu(L + (b * 16 + i) * R + rb * 16);
      if (!all_seen) v[i] = splat((float)(b * 16 + i)) <= last ? v[i] : splat(kNegInf);
    }
    for (int s = 8; s > 0; s /= 2)  // a max is exact: any order gives the same one
      for (int i = 0; i < s; ++i) v[i] = vmax(v[i], v[i + s]);
    storeu(mx + rb * 16, vmax(loadu(mx + rb * 16), v[0]));
  }
}

// Key blocks fetched ahead into L2 (the next item's first blocks too): 4 hides the DRAM latency
// behind the tile work of the blocks between (S1's shape: 2, 4 and 8 within 3%).
constexpr int64_t kPrefetchBlocks = 4;

// Logits of every key against every row into L[key][row] (keys past n: zero-key logits), and
// the rows' maxima into mx unless it is null.
static void window_fused_logits(const WindowFusedArgs& a, int64_t kvh, const uint32_t* qp,
                                float* L, uint16_t* stage, const float* thr, float* mx) {
  const int64_t d = a.head_dim, chunks = d / kAmxChunk, R = a.rows;
  const bool resident = chunks <= 4;  // the block's key tiles stay loaded across row blocks
  for (int64_t b = 0; b < a.num_blocks; ++b) {
    const uint16_t* K = a.key_blocks[kvh * a.num_blocks + b];
    int64_t stride = a.key_row_stride;
    const int64_t nk = a.n - b * 16 < 16 ? a.n - b * 16 : 16;
    if (nk < 16) {  // the last, partial block: its rows past n may not be readable
      for (int64_t i = 0; i < nk; ++i) __builtin_memcpy(stage + i * d, K + i * stride, d * 2);
      __builtin_memset(stage + nk * d, 0, (16 - nk) * d * 2);
      K = stage;
      stride = d;
    }
    // Key blocks are 16 rows anywhere in memory (random pages): without a prefetch each
    // block's first tile load waits on DRAM (~40% of the kernel's time at S1's shape).
    if (kvh * a.num_blocks + b + kPrefetchBlocks < a.num_kv_heads * a.num_blocks) {
      const char* ahead = reinterpret_cast<const char*>(
          a.key_blocks[kvh * a.num_blocks + b + kPrefetchBlocks]);
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t o = 0; o < d * 2; o += 64)
          __builtin_prefetch(ahead + i * a.key_row_stride * 2 + o, 0, 2);
    }
    if (resident) window_fused_load_keys(K, stride, 0, chunks);
    for (int64_t rb = 0; rb < R / 16; ++rb) {
      _tile_zero(0);
      for (int64_t ch = 0; ch < chunks; ch += 4) {
        const int64_t count = chunks - ch < 4 ? chunks - ch : 4;
        if (!resident) window_fused_load_keys(K, stride, ch, count);
        window_fused_dot(qp + (rb * chunks + ch) * 256, count);
      }
      _tile_stored(0, L + b * 16 * R + rb * 16, R * 4);
    }
    if (mx != nullptr) window_fused_block_max(a, b, L, thr, mx);
  }
}

// Pass 2 for row blocks rb0 .. rb0 + count - 1 (count <= 4): probabilities exp(logit - lse)
// over L in place (zero where a row does not see the key), and 1 / their row sums (1 where the
// LSE was given).
static void window_fused_softmax(const WindowFusedArgs& a, int64_t rb0, int count, float* L,
                                 const float* thr, const float* mx, float* lse_row,
                                 float* inv_sum) {
  const int64_t R = a.rows, keys = a.num_blocks * 16;
  const vf qscale = splat(a.scale * kLog2e);
  vf last[4], shift[4], sum[4];  // shift: the base-2 logit subtracted before exp2
  for (int t = 0; t < 4; ++t) {
    const int64_t off = (rb0 + (t < count ? t : 0)) * 16;
    last[t] = loadu(thr + off);
    // Padding rows (last = -1) see nothing: any finite shift, their terms are masked.
    shift[t] = a.lse_in != nullptr       ? loadu(lse_row + off) * splat(kLog2e)
               : last[t] >= splat(0.0f) ? loadu(mx + off) * qscale
                                        : splat(0.0f);
    sum[t] = splat(0.0f);
  }
  // Without padding rows every row sees keys 0 .. n - w: no mask there.
  const int64_t unmasked = a.group * a.w == R ? a.n - a.w + 1 : 0;
  for (int64_t j = 0; j < unmasked; ++j)
    for (int t = 0; t < 4; ++t) {
      if (t >= count) break;
      float* p = L + j * R + (rb0 + t) * 16;
      const vf e = vexp2(loadu(p) * qscale - shift[t]);
      storeu(p, e);
      sum[t] += e;
    }
  for (int64_t j = unmasked; j < keys; ++j) {
    const vf key = splat((float)j);
    for (int t = 0; t < 4; ++t) {
      if (t >= count) break;
      float* p = L + j * R + (rb0 + t) * 16;
      const vf e = vexp2(loadu(p) * qscale - shift[t]);
      const vf kept = key <= last[t] ? e : splat(0.0f);
      storeu(p, kept);
      sum[t] += kept;
    }
  }
  for (int t = 0; t < count; ++t) {
    const int64_t off = (rb0 + t) * 16;
    if (a.lse_in != nullptr) {
      storeu(inv_sum + off, splat(1.0f));
      continue;
    }
    float s[16], sh[16];
    __builtin_memcpy(s, &sum[t], sizeof(s));
    __builtin_memcpy(sh, &shift[t], sizeof(sh));
    for (int c = 0; c < 16; ++c) {
      const bool row = thr[off + c] >= 0.0f;
      lse_row[off + c] = row ? (sh[c] + __builtin_log2f(s[c])) * kLn2 : 0.0f;
      inv_sum[off + c] = row ? 1.0f / s[c] : 0.0f;
    }
  }
}

// Pass 3: out[h, j] = sum over head h's rows of L[j][row] * inv_sum[row], one block of 16 keys
// (all heads) at a time.
static void window_fused_columns(const WindowFusedArgs& a, int64_t kvh, const float* L,
                                 const float* inv_sum) {
  const int64_t R = a.rows;
  for (int64_t b = 0; b < a.num_blocks; ++b) {
    const int64_t nk = a.n - b * 16 < 16 ? a.n - b * 16 : 16;
    for (int64_t h = 0; h < a.group; ++h) {
      const int64_t r0 = h * a.w, r1 = r0 + a.w;
      vf acc[16];
      for (int i = 0; i < 16; ++i) acc[i] = splat(0.0f);
      for (int64_t rb = r0 / 16; rb * 16 < r1; ++rb) {
        float weight[16];  // 1 / row sum on this head's lanes, 0 on the others
        for (int c = 0; c < 16; ++c) {
          const int64_t row = rb * 16 + c;
          weight[c] = row >= r0 && row < r1 ? inv_sum[row] : 0.0f;
        }
        const vf wv = loadu(weight);
        const float* col = L + b * 16 * R + rb * 16;
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] += loadu(col + i * R) * wv;
      }
      const vf total = reduce_lanes(acc);  // lane i: key b * 16 + i
      float t[16];
      __builtin_memcpy(t, &total, sizeof(t));
      float* out = a.out + (kvh * a.group + h) * a.n + b * 16;
      for (int64_t i = 0; i < nk; ++i) out[i] = t[i];
    }
  }
}

static void window_fused_item_amx(const WindowFusedArgs& a, int64_t kvh, float* scratch) {
  const int64_t R = a.rows, d = a.head_dim;
  float* base = scratch + (16 - (reinterpret_cast<uintptr_t>(scratch) / 4) % 16) % 16;
  uint32_t* qp = reinterpret_cast<uint32_t*>(base + 16);
  float* L = base + 16 + R * d / 2;
  uint16_t* stage = reinterpret_cast<uint16_t*>(L + a.num_blocks * 16 * R);
  float* thr = L + a.num_blocks * 16 * R + 8 * d;
  float* lse_row = thr + R;
  float* inv_sum = lse_row + R;
  float* mx = inv_sum + R;
  const int64_t used = a.group * a.w;
  for (int64_t r = 0; r < R; ++r) {
    thr[r] = r < used ? (float)(a.n - a.w + r % a.w) : -1.0f;
    lse_row[r] = 0.0f;
    mx[r] = kNegInf;
    if (r < used && a.lse_in != nullptr)
      lse_row[r] = a.lse_in[(kvh * a.group + r / a.w) * a.w + r % a.w];
  }
  window_fused_pack_queries(a, kvh, qp);
  configure_window_tiles(reinterpret_cast<TileConfig*>(base));
  window_fused_logits(a, kvh, qp, L, stage, thr, a.lse_in == nullptr ? mx : nullptr);
  _tile_release();  // see decode_item_amx
  for (int64_t rb = 0; rb < R / 16; rb += 4) {
    const int count = R / 16 - rb < 4 ? (int)(R / 16 - rb) : 4;
    window_fused_softmax(a, rb, count, L, thr, mx, lse_row, inv_sum);
  }
  window_fused_columns(a, kvh, L, inv_sum);
  for (int64_t r = 0; r < used; ++r)
    a.lse_out[(kvh * a.group + r / a.w) * a.w + r % a.w] = lse_row[r];
}
