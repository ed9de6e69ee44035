// Fused window scores and log-sum-exps on AMX tiles (included by isa_avx512_amx.cpp after
// window_amx.h; interface and semantics in window_fused.h).
//
// One item is one KV head: its group x w window rows (rows r = h * w + i, padded to whole
// 16-row blocks) against all n keys.
// 1. The rows' queries are packed into element pairs once (the B operand), then every block of
//    16 keys gives C^T[16 keys][16 rows] per row block, as window_amx.h computes it, stored to a
//    logits buffer L[keys][rows] (n x rows fp32: 400 KB for 1040 keys x 96 rows, L2-resident).
// 2. Per row block, down the keys with 16 rows per vector: the masked running max, then one
//    exp2 per logit written back over it with the row sums alongside (or, with the LSE given,
//    exp2(logit - lse) at once).
// 3. Per head and block of 16 keys: the head's row vectors times 1 / sum, accumulated per key
//    and reduced 16 keys at once (reduce_lanes).
// Logits are exact bf16 products summed in fp32, as in every other kernel here.

static int64_t window_fused_scratch_amx(const WindowFusedArgs& a) {
  return 32 + a.rows * a.head_dim / 2 + a.num_blocks * 16 * a.rows + 8 * a.head_dim +
         3 * a.rows + 64;
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

// Logits of every key against every row into L[key][row] (keys past n: zero-key logits).
static void window_fused_logits(const WindowFusedArgs& a, int64_t kvh, const uint32_t* qp,
                                float* L, uint16_t* stage) {
  const int64_t d = a.head_dim, chunks = d / kAmxChunk, R = a.rows;
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
    for (int64_t rb = 0; rb < R / 16; ++rb) {
      _tile_zero(0);
      for (int64_t ch = 0; ch < chunks; ++ch) {
        _tile_loadd(2, K + ch * kAmxChunk, stride * 2);
        _tile_loadd(3, qp + (rb * chunks + ch) * 256, 64);
        _tile_dpbf16ps(0, 2, 3);
      }
      _tile_stored(0, L + b * 16 * R + rb * 16, R * 4);
    }
  }
}

// Pass 2 for one row block: probabilities exp(logit - lse) over L in place (zero where a row
// does not see the key), and 1 / their row sums (1 where the LSE was given).
static void window_fused_softmax(const WindowFusedArgs& a, int64_t kvh, int64_t rb, float* L,
                                 const float* thr, float* lse_row, float* inv_sum) {
  const int64_t R = a.rows, keys = a.num_blocks * 16, off = rb * 16;
  const vf last = loadu(thr + off), qscale = splat(a.scale * kLog2e);
  vf shift;  // base-2 logit subtracted before exp2
  if (a.lse_in != nullptr) {
    shift = loadu(lse_row + off) * splat(kLog2e);
  } else {
    vf m = splat(kNegInf);
    for (int64_t j = 0; j < a.n; ++j) {
      const vf v = loadu(L + j * R + off);
      m = splat((float)j) <= last ? vmax(m, v) : m;
    }
    // Padding rows (last = -1) see nothing: any finite shift, their terms are masked.
    shift = last >= splat(0.0f) ? m * qscale : splat(0.0f);
  }
  vf sum = splat(0.0f);
  for (int64_t j = 0; j < keys; ++j) {
    float* p = L + j * R + off;
    const vf e = vexp2(loadu(p) * qscale - shift);
    const vf kept = splat((float)j) <= last ? e : splat(0.0f);
    storeu(p, kept);
    sum += kept;
  }
  if (a.lse_in != nullptr) {
    storeu(inv_sum + off, splat(1.0f));
    return;
  }
  float s[16], sh[16];
  __builtin_memcpy(s, &sum, sizeof(s));
  __builtin_memcpy(sh, &shift, sizeof(sh));
  for (int c = 0; c < 16; ++c) {
    const bool row = thr[off + c] >= 0.0f;
    lse_row[off + c] = row ? (sh[c] + __builtin_log2f(s[c])) * kLn2 : 0.0f;
    inv_sum[off + c] = row ? 1.0f / s[c] : 0.0f;
  }
}

// Pass 3: out[h, j] = sum over head h's rows of L[j][row] * inv_sum[row].
static void window_fused_columns(const WindowFusedArgs& a, int64_t kvh, const float* L,
                                 const float* inv_sum) {
  const int64_t R = a.rows;
  for (int64_t h = 0; h < a.group; ++h) {
    const int64_t r0 = h * a.w, r1 = r0 + a.w;
    float* out = a.out + (kvh * a.group + h) * a.n;
    for (int64_t b = 0; b < a.num_blocks; ++b) {
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
      const int64_t nk = a.n - b * 16 < 16 ? a.n - b * 16 : 16;
      for (int64_t i = 0; i < nk; ++i) out[b * 16 + i] = t[i];
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
  const int64_t used = a.group * a.w;
  for (int64_t r = 0; r < R; ++r) {
    thr[r] = r < used ? (float)(a.n - a.w + r % a.w) : -1.0f;
    lse_row[r] = 0.0f;
    if (r < used && a.lse_in != nullptr)
      lse_row[r] = a.lse_in[(kvh * a.group + r / a.w) * a.w + r % a.w];
  }
  window_fused_pack_queries(a, kvh, qp);
  configure_window_tiles(reinterpret_cast<TileConfig*>(base));
  window_fused_logits(a, kvh, qp, L, stage);
  _tile_release();  // see decode_item_amx
  for (int64_t rb = 0; rb < R / 16; ++rb) window_fused_softmax(a, kvh, rb, L, thr, lse_row, inv_sum);
  window_fused_columns(a, kvh, L, inv_sum);
  for (int64_t r = 0; r < used; ++r)
    a.lse_out[(kvh * a.group + r / a.w) * a.w + r % a.w] = lse_row[r];
}
