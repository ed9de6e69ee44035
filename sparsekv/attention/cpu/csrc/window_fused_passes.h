// The vector passes of the fused window-score kernels (window_fused.h): query packing, each
// row's running max, the softmax over the logits buffer and the per-key column sums; included by
// the AMX unit (window_fused_amx.h) and the AVX512-BF16 unit (window_fused_bf16.h), which differ
// only in how they compute the logits L[keys][rows]. See window_fused_amx.h for the passes.
//
// Needs kernel_impl.h's vector helpers (vf, vi, vexp2, vmax, vmin, reduce_lanes) with SKV_W 16.

constexpr int64_t kPairWords = 32;  // bf16 elements of 16 query pairs

// Query element pairs of KV head kvh's rows: qp[(rb * chunks + ch) * 256 + p * 16 + c] holds
// elements 2p, 2p + 1 of chunk ch of row rb * 16 + c (zero for padding rows).
static void window_fused_pack_queries(const WindowFusedArgs& a, int64_t kvh, uint32_t* qp) {
  const int64_t chunks = a.head_dim / kPairWords, used = a.group * a.w;
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
            const uint16_t* e = q + ch * kPairWords + 2 * p;
            pair = (uint32_t)e[0] | ((uint32_t)e[1] << 16);
          }
          qp[(rb * chunks + ch) * 256 + p * 16 + c] = pair;
        }
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

// The end of pass 2 for the 16 rows from off: each row's lse (its shift times the scale plus
// the log of its sum s) and 1 / s; with a given LSE, 1 (the terms are already normalized).
// Padding rows (thr < 0) get 0.
static inline void window_fused_finish_rows(const WindowFusedArgs& a, int64_t off,
                                            const float* s, const float* sh, const float* thr,
                                            float* lse_row, float* inv_sum) {
  for (int c = 0; c < 16; ++c) {
    if (a.lse_in != nullptr) {
      inv_sum[off + c] = 1.0f;
      continue;
    }
    const bool row = thr[off + c] >= 0.0f;
    lse_row[off + c] = row ? sh[c] * a.scale + __builtin_logf(s[c]) : 0.0f;
    inv_sum[off + c] = row ? 1.0f / s[c] : 0.0f;
  }
}

// Pass 2 for row blocks rb0 .. rb0 + count - 1 (count <= 4): probabilities exp(logit - lse)
// over L in place (zero where a row does not see the key), and 1 / their row sums (1 where the
// LSE was given).
//
// Each row's reference is subtracted from the unscaled logits before the scale: its max (the
// max key's term is then exactly 1), or the given lse divided by the scale. A fused
// logit * scale - reference would carry the unrounded product against a rounded reference,
// off by up to half a unit in the reference's last place in the exponent: NaN rows at logit
// gaps of ~1e9. The terms are capped at 1, which exp(logit - lse) never exceeds: a given lse
// that rounding leaves below a row's max (huge logits) cannot overflow the sums.
static void window_fused_softmax(const WindowFusedArgs& a, int64_t rb0, int count, float* L,
                                 const float* thr, const float* mx, float* lse_row,
                                 float* inv_sum) {
  const int64_t R = a.rows, keys = a.num_blocks * 16;
  const vf qscale = splat(a.scale * kLog2e), one = splat(1.0f);
  vf last[4], shift[4], sum[4];  // shift: the unscaled logit subtracted before the scale
  for (int t = 0; t < 4; ++t) {
    const int64_t off = (rb0 + (t < count ? t : 0)) * 16;
    last[t] = loadu(thr + off);
    // Padding rows (last = -1) see nothing: any finite shift, their terms are masked.
    shift[t] = a.lse_in != nullptr       ? loadu(lse_row + off) / splat(a.scale)
               : last[t] >= splat(0.0f) ? loadu(mx + off)
                                        : splat(0.0f);
    sum[t] = splat(0.0f);
  }
  // Without padding rows every row sees keys 0 .. n - w: no mask there.
  const int64_t unmasked = a.group * a.w == R ? a.n - a.w + 1 : 0;
  for (int64_t j = 0; j < unmasked; ++j)
    for (int t = 0; t < 4; ++t) {
      if (t >= count) break;
      float* p = L + j * R + (rb0 + t) * 16;
      const vf e = vmin(vexp2((loadu(p) - shift[t]) * qscale), one);
      storeu(p, e);
      sum[t] += e;
    }
  for (int64_t j = unmasked; j < keys; ++j) {
    const vf key = splat((float)j);
    for (int t = 0; t < 4; ++t) {
      if (t >= count) break;
      float* p = L + j * R + (rb0 + t) * 16;
      const vf e = vmin(vexp2((loadu(p) - shift[t]) * qscale), one);
      const vf kept = key <= last[t] ? e : splat(0.0f);
      storeu(p, kept);
      sum[t] += kept;
    }
  }
  for (int t = 0; t < count; ++t) {
    float s[16], sh[16];
    __builtin_memcpy(s, &sum[t], sizeof(s));
    __builtin_memcpy(sh, &shift[t], sizeof(sh));
    window_fused_finish_rows(a, (rb0 + t) * 16, s, sh, thr, lse_row, inv_sum);
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
        const vf wv = loadu(inv_sum + rb * 16);  // 1 / row sum of each lane's row
        const float* col = L + b * 16 * R + rb * 16;
        if (rb * 16 >= r0 && rb * 16 + 16 <= r1) {  // every lane this head's
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) acc[i] += loadu(col + i * R) * wv;
          continue;
        }
        // A block shared with another head: the other head's lanes are masked out (not
        // weighted by 0, so a NaN row of one head cannot reach the others' sums).
        int32_t lane[16];
        for (int c = 0; c < 16; ++c) lane[c] = rb * 16 + c >= r0 && rb * 16 + c < r1 ? -1 : 0;
        vi own;
        __builtin_memcpy(&own, lane, sizeof(own));
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] += (vf)((vi)(loadu(col + i * R) * wv) & own);
      }
      const vf total = reduce_lanes(acc);  // lane i: key b * 16 + i
      float t[16];
      __builtin_memcpy(t, &total, sizeof(t));
      float* out = a.out + (kvh * a.group + h) * a.n + b * 16;
      for (int64_t i = 0; i < nk; ++i) out[i] = t[i];
    }
  }
}
