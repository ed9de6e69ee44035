// bf16 decode attention on AMX tiles (included by isa_avx512_amx.cpp after amx_util.h).
//
// Why: at GQA group 3 and head_dim 64 the vector kernel spends more time on arithmetic (bf16
// to fp32 unpacking, FMAs, lane reductions: ~15 ns per slot and KV head on one core with the
// data in L2) than memory needs. One TDPBF16PS multiplies [16 x 32] by [32 x 16] bf16 with
// fp32 accumulation in ~16 cycles. (VDPBF16PS, AVX512-BF16, was measured at one per 2 cycles
// here: slower per multiply-add than fp32 FMAs, so it does not pay on its own.)
//
// Logits, per 16 slots of a page: C[16 slots][g] += A[16 key rows][32 elements] *
// B[32 elements][g heads], A loaded straight from the page (rows head_dim apart), B the query
// block in pairs ("VNNI": row r holds q[h][2r], q[h][2r + 1] for each head h). The query is
// the raw bf16 input, unscaled, so products are exact; the scale multiplies the fp32 logits.
// Values, per tile: C[g][16 columns] = A[g][32 slots] * B[32 slots][16 columns], A the
// probabilities rounded to bf16, B 32 value rows interleaved in pairs (unpacklo/hi_epi16 of
// rows t, t + 1, which work per 128-bit lane: hence chunk_pos's order under SKV_AMX). The
// softmax denominator sums the unrounded fp32 probabilities.
//
// The online softmax, tiles, first_slot, splits and scores are those of decode_impl.h.
// TDPBF16PS has a long latency, so both steps run two independent tile chains.

// Scratch of one thread, carved from decode_item's float buffer.
struct AmxScratch {
  TileConfig* cfg;
  uint32_t* qpairs;  // per head block of g heads: [chunks][16][g] query pairs
  float* sc;         // [kAmxMaxHeads][ss] logits, then probabilities
  uint16_t* pb;      // [kAmxMaxHeads][pss] probabilities in bf16, zero-padded to pss
  uint32_t* vbuf;    // [ksteps][chunks][lo, hi][16][16] value pairs
  float* cbuf;       // two C tiles of 256 floats (+ slack for the column permutes)
  uint16_t* stage;   // [2][16][head_dim] key rows of page tails shorter than 16 rows
  const uint16_t** rows;  // [pss] value row pointers of the tile
  int64_t ss, pss;
  LinePrefetcher* prefetch;
};

// Floats of AmxScratch (carved from `base` into `out` when given); parts are 64-byte aligned
// relative to base.
static int64_t amx_scratch(const DecodeArgs& a, float* base, AmxScratch* out) {
  const int64_t G = a.num_heads / a.num_kv_heads, d = a.head_dim;
  const int64_t cap = kTileSlots > a.block_size ? kTileSlots : a.block_size;
  const int64_t ss = cap + 2 * W, pss = (cap + kAmxChunk - 1) / kAmxChunk * kAmxChunk;
  const int64_t sizes[8] = {16, G * d / 2, kAmxMaxHeads * ss, kAmxMaxHeads * pss / 2,
                            pss / kAmxChunk * (d / kAmxChunk) * 512, 2 * 256 + 32, 16 * d, 2 * pss};
  float* parts[8];
  const int64_t used = carve_scratch(base, sizes, 8, parts);
  if (out != nullptr)
    *out = {reinterpret_cast<TileConfig*>(parts[0]), reinterpret_cast<uint32_t*>(parts[1]),
            parts[2], reinterpret_cast<uint16_t*>(parts[3]), reinterpret_cast<uint32_t*>(parts[4]),
            parts[5], reinterpret_cast<uint16_t*>(parts[6]),
            reinterpret_cast<const uint16_t**>(parts[7]), ss, pss, nullptr};
  return used;
}

struct RowGroup {      // 16 key rows of a page and the lanes of their logits to keep
  const uint16_t* k;   // [16][head_dim]
  float* dst;          // logit of row i goes to dst[h * ss + i]
  __mmask16 keep;
};

// Base-2 logits of up to two row groups for g heads (two tile chains).
static void group_logits(const DecodeArgs& a, const RowGroup* grp, int count,
                         const uint32_t* qpairs, int g, const AmxScratch& w) {
  const int64_t d = a.head_dim, chunks = d / kAmxChunk, stride = d * sizeof(uint16_t);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < chunks; ++c) {
    _tile_loadd(4, qpairs + c * 16 * g, 4 * g);
    _tile_loadd(2, grp[0].k + c * kAmxChunk, stride);
    _tile_dpbf16ps(0, 2, 4);
    if (count > 1) {
      _tile_loadd(3, grp[1].k + c * kAmxChunk, stride);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  _tile_stored(0, w.cbuf, 4 * g);
  if (count > 1) _tile_stored(1, w.cbuf + 256, 4 * g);
  const __m512 qscale = _mm512_set1_ps(a.scale * kLog2e);
  for (int i = 0; i < count; ++i)
    for (int h = 0; h < g; ++h)
      _mm512_mask_storeu_ps(grp[i].dst + h * w.ss, grp[i].keep,
                            _mm512_mul_ps(tile_column(w.cbuf + i * 256, g, h), qscale));
}

// Base-2 logits of the tile's slots for g heads into sc[h * ss + t], t < n.
static void tile_logits_amx(const DecodeArgs& a, const PageSpan<uint16_t>* cur, int nc,
                            const int64_t* offs, const uint32_t* qpairs, int g,
                            const AmxScratch& w) {
  const int64_t bs = a.block_size, d = a.head_dim;
  RowGroup grp[2];
  int count = 0;
  for (int k = 0; k < nc; ++k) {
    const int64_t j0 = cur[k].j0, j1 = j0 + cur[k].n;
    // Row groups are aligned to the page: one may start before j0 (sliding window,
    // first_slot) or end past j1; their lanes outside [j0, j1) are masked off, and dst may
    // point up to 15 floats before the span's logits (never touched).
    for (int64_t r = j0 / 16 * 16; r < j1; r += 16) {
      w.prefetch->step();
      const uint16_t* K = cur[k].k + r * d;
      if (r + 16 > bs) {  // fewer than 16 rows left in the page: stage them, zero the rest
        uint16_t* stage = w.stage + count * 16 * d;
        __builtin_memcpy(stage, K, (bs - r) * d * sizeof(uint16_t));
        __builtin_memset(stage + (bs - r) * d, 0, (16 - (bs - r)) * d * sizeof(uint16_t));
        K = stage;
      }
      const int64_t lo = j0 > r ? j0 - r : 0, hi = j1 - r < 16 ? j1 - r : 16;
      grp[count++] = {K, w.sc + offs[k] + (r - j0),
                      (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1))};
      if (count == 2) {
        group_logits(a, grp, count, qpairs, g, w);
        count = 0;
      }
    }
  }
  if (count > 0) group_logits(a, grp, count, qpairs, g, w);
}

// Probabilities of g heads rounded to bf16 (to nearest even), zero from n up to pss.
static void round_probabilities(const float* sc, int64_t ss, int g, int64_t n, uint16_t* pb,
                                int64_t pss) {
  for (int h = 0; h < g; ++h)
    for (int64_t t = 0; t < pss; t += 16) {
      const __mmask16 valid = t >= n ? 0 : t + 16 <= n ? 0xffff : (1u << (n - t)) - 1;
      const __m512 p = _mm512_maskz_loadu_ps(valid, sc + h * ss + t);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + h * pss + t),
                          (__m256i)_mm512_cvtneps_pbh(p));
    }
}

// Value rows t, t + 1 of the tile interleaved into pairs, in w.vbuf. Rows past the tile are
// zero: a page's unheld slots may hold anything, NaN included, and 0 * NaN is NaN.
static void pair_values(const DecodeArgs& a, const PageSpan<uint16_t>* cur, int nc,
                        const int64_t* offs, int64_t ksteps, const AmxScratch& w) {
  const int64_t d = a.head_dim, chunks = d / kAmxChunk, n = offs[nc];
  const int64_t kv_stride = a.num_kv_heads * a.block_size * d;
  const uint16_t** rows = w.rows;  // value row of each tile slot, nullptr past the tile
  for (int k = 0, t = 0; k < nc; ++k)
    for (int64_t j = 0; j < cur[k].n; ++j, ++t) rows[t] = cur[k].k + kv_stride + (cur[k].j0 + j) * d;
  for (int64_t t = n; t < ksteps * kAmxChunk; ++t) rows[t] = nullptr;
  for (int64_t p = 0; p < ksteps * 16; ++p) {
    w.prefetch->step();
    const uint16_t* r0 = rows[2 * p];
    const uint16_t* r1 = rows[2 * p + 1];
    uint32_t* dst = w.vbuf + (p / 16) * chunks * 512 + (p % 16) * 16;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i v0 = r0 ? _mm512_loadu_si512(r0 + c * kAmxChunk) : _mm512_setzero_si512();
      const __m512i v1 = r1 ? _mm512_loadu_si512(r1 + c * kAmxChunk) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + c * 512, _mm512_unpacklo_epi16(v0, v1));
      _mm512_storeu_si512(dst + c * 512 + 256, _mm512_unpackhi_epi16(v0, v1));
    }
  }
}

// acc[h] = acc[h] * alpha[h] + P[h] . V over the tile, for g heads.
static void tile_values_amx(const DecodeArgs& a, const PageSpan<uint16_t>* cur, int nc,
                            const int64_t* offs, int g, const float* alpha, float* state,
                            const AmxScratch& w) {
  const int64_t d = a.head_dim, st = d + 2, chunks = d / kAmxChunk;
  const int64_t ksteps = (offs[nc] + kAmxChunk - 1) / kAmxChunk;
  pair_values(a, cur, nc, offs, ksteps, w);
  // Two blocks of 16 output columns at a time (column block: chunk col / 2, lo / hi).
  const int64_t pstride = w.pss * sizeof(uint16_t);
  if (ksteps == 1) _tile_loadd(7, w.pb, pstride);
  for (int64_t col = 0; col < 2 * chunks; col += 2) {
    w.prefetch->step();
    _tile_zero(5);
    _tile_zero(6);
    for (int64_t ks = 0; ks < ksteps; ++ks) {
      if (ksteps > 1) _tile_loadd(7, w.pb + ks * kAmxChunk, pstride);
      _tile_loadd(2, w.vbuf + (ks * chunks * 2 + col) * 256, 64);
      _tile_dpbf16ps(5, 7, 2);
      _tile_loadd(3, w.vbuf + (ks * chunks * 2 + col + 1) * 256, 64);
      _tile_dpbf16ps(6, 7, 3);
    }
    _tile_stored(5, w.cbuf, 64);
    _tile_stored(6, w.cbuf + 256, 64);
    for (int h = 0; h < g; ++h) {
      float* acc = state + h * st + 2 + col * 16;
      const vf scale = splat(alpha[h]);
      storeu(acc, loadu(acc) * scale + loadu(w.cbuf + h * 16));
      storeu(acc + 16, loadu(acc + 16) * scale + loadu(w.cbuf + 256 + h * 16));
    }
  }
}

static void tile_update_amx(const DecodeArgs& a, int g, const PageSpan<uint16_t>* cur, int nc,
                            const uint32_t* qpairs, float* state, float* scores,
                            const AmxScratch& w) {
  int64_t offs[kMaxTilePages + 1];
  offs[0] = 0;
  for (int k = 0; k < nc; ++k) offs[k + 1] = offs[k] + cur[k].n;
  tile_logits_amx(a, cur, nc, offs, qpairs, g, w);
  float alpha[kAmxMaxHeads];
  tile_softmax<uint16_t>(a, g, cur, nc, offs, w.sc, w.ss, state, scores, alpha);
  round_probabilities(w.sc, w.ss, g, offs[nc], w.pb, w.pss);
  tile_values_amx(a, cur, nc, offs, g, alpha, state, w);
}

// Query pairs of each head block of up to 16 heads: q[h] read as d / 2 words of two elements.
static void query_pairs(const DecodeArgs& a, const DecodeItem& it, uint32_t* qpairs) {
  const int64_t G = a.num_heads / a.num_kv_heads, half = a.head_dim / 2;
  const uint32_t* q = static_cast<const uint32_t*>(a.query) +
                      (it.b * a.num_heads + it.kvh * G) * half;
  for (int64_t h0 = 0; h0 < G; h0 += kAmxMaxHeads) {
    const int64_t g = G - h0 < kAmxMaxHeads ? G - h0 : kAmxMaxHeads;
    for (int64_t c = 0; c < half / 16; ++c)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t h = 0; h < g; ++h)
          qpairs[h0 * half + (c * 16 + r) * g + h] = q[(h0 + h) * half + c * 16 + r];
  }
}

static void decode_item_amx(const DecodeArgs& a, const DecodeItem& it, float* scratch,
                            float* state) {
  const int64_t G = a.num_heads / a.num_kv_heads, d = a.head_dim, st = d + 2;
  const int64_t kv_stride = a.num_kv_heads * a.block_size * d;
  AmxScratch w;
  amx_scratch(a, scratch + (16 - (reinterpret_cast<uintptr_t>(scratch) / 4) % 16) % 16, &w);
  LinePrefetcher prefetch;
  w.prefetch = &prefetch;
  query_pairs(a, it, w.qpairs);
  for (int64_t h = 0; h < G; ++h) {
    state[h * st] = kNegInf;
    for (int64_t e = 1; e < st; ++e) state[h * st + e] = 0.0f;
  }
  // A ring of three tiles: the current one, the next (prefetched line by line while the
  // current one is processed) and the one after (its runs touched to start the streamer).
  PageSpan<uint16_t> tiles[3][kMaxTilePages];
  int count[3];
  int64_t pi = it.page_begin;
  for (int i = 0; i < 2; ++i) {
    count[i] = next_tile<uint16_t>(a, it, &pi, tiles[i]);
    touch_runs(a, tiles[i], count[i], kv_stride, d);
  }
  int configured = 0;
  for (int cur = 0; count[cur] > 0; cur = (cur + 1) % 3) {
    const int next = (cur + 1) % 3, after = (cur + 2) % 3;
    count[after] = next_tile<uint16_t>(a, it, &pi, tiles[after]);
    touch_runs(a, tiles[after], count[after], kv_stride, d);
    prefetch.finish();
    prefetch.start(tiles[next], count[next], kv_stride, d);
    for (int64_t h0 = 0; h0 < G; h0 += kAmxMaxHeads) {
      const int g = (int)(G - h0 < kAmxMaxHeads ? G - h0 : kAmxMaxHeads);
      if (g != configured) configure_decode_tiles(w.cfg, configured = g);
      float* scores = nullptr;
      if (a.scores != nullptr)
        scores = a.scores + ((it.b * a.num_kv_heads + it.kvh) * G + h0) * a.held_cap;
      tile_update_amx(a, g, tiles[cur], count[cur], w.qpairs + h0 * d / 2, state + h0 * st,
                      scores, w);
    }
  }
  // Leave no tile state behind: it would make every context switch of this thread save 8 KiB.
  _tile_release();
}

// Table entries of the AMX unit: bf16 on tiles; fp32, int8 and fp8 on the vector kernel.
static int64_t decode_scratch_amx(const DecodeArgs& a) {
  const int64_t vector = decode_scratch(a), tiles = amx_scratch(a, nullptr, nullptr) + 16;
  return vector > tiles ? vector : tiles;
}

static void decode_item_or_amx(const DecodeArgs& a, const DecodeItem& it, float* scratch,
                               float* state) {
  if (a.kv_type == kKvBFloat16)
    decode_item_amx(a, it, scratch, state);
  else
    decode_item(a, it, scratch, state);
}
