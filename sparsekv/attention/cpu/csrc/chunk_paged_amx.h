// Multi-query paged attention on AMX tiles for bf16 pages (chunk_paged.h): included at the end
// of chunk_paged_impl.h by the avx512_amx chunk unit (SKV_CHUNK_AMX), after
// chunk_paged_bf16.h, whose query, key-run and value-pair helpers it uses.
//
// Why: a speculative verification is a short chunk (K + 1 rows, times the GQA group: 15
// columns per KV head for SmolLM2 with K = 4) over thousands of held slots, a memory-bound
// read of the pages like a decode step. The AVX512-BF16 path spends ~130 vector instructions
// per key on its two products (vdpbf16ps is no cheaper than fp32 FMAs on Intel cores), which
// makes it compute-bound at 2-3x a decode step's time on AMX machines. Here both products run
// on tiles, and the softmax costs a few instructions per key for 16 columns at once.
//
// An item's columns are its rows (col = h * num_rows + r, head h of the group, chunk row r, as
// chunk_scaled_queries numbers them), 16 per column tile, at most kAmxChunkCols. Per tile of
// 32 keys (chunk_each_tile, a.tile = kChunkTileKeysBf16):
// - logits, transposed: S^T[16 keys][16 cols] = K[16 keys][32 elements] x Qpairs[16 element
//   pairs][16 cols], K loaded straight from the page when the 16 keys are consecutive rows of
//   one page (else staged), the queries scaled and rounded to bf16 once per item;
// - the online softmax down each column, lane-wise (no horizontal reduction), with the lazy
//   max of the prefill kernels (lazy_softmax.h): no max pass and no rescale once a column's max
//   is known, unless a block's sum leaves the safe range;
// - values: O[16 cols][16 dims] += P[16 cols][32 keys] x Vpairs[16 key pairs][16 dims], P the
//   probability pairs transposed (one 16 x 16 word transpose per column tile), Vpairs the value
//   rows interleaved in pairs (bf16_value_pairs), O in the item's scratch.
// At the end O goes to the item's state in the unit's chunk order, so chunk_combine merges the
// items of a row block unchanged. Probabilities enter the value product rounded to bf16 and the
// sums add them unrounded, as in the prefill kernels.
//
// Tile registers (all 16 rows x 64 bytes): 0, 1 logits of the two key halves, then output
// blocks; 2, 3 key rows, then value pairs; 4 query pairs; 6 probability rows.

#if !defined(SKV_CHUNK_BF16)
#error "chunk_paged_amx.h needs chunk_paged_bf16.h (SKV_CHUNK_BF16)"
#endif

constexpr int64_t kAmxChunkCols = 32;  // columns (group x rows) of an item on tiles
// Keys per tile (a.tile of bf16 pages): the logits buffer, the two 16-key halves and the 16
// probability pairs below are sized for exactly 32.
static_assert(kChunkTileKeysBf16 == 32, "the AMX chunk item takes 32-key tiles");

struct ChunkAmxScratch {
  TileConfig* cfg;
  uint32_t* qp;      // [d / 2][rp] query pairs (bf16_load_queries)
  float* qf;         // [rp][d] bf16_load_queries' scratch
  float* s;          // [tiles][32 keys][16 cols] logits
  uint32_t* pp;      // [16 key pairs][16 cols] probability pairs of one column tile
  uint32_t* pa;      // [16 cols][16 key pairs] the same transposed: the A tile of the values
  uint32_t* vp;      // [16 key pairs][d] value pairs
  float* o;          // [rp][d] output accumulators, natural element order
  float* m;          // [rp] reference max of each column (base 2), kNoMax before any key
  float* l;          // [rp] sum of exp2(logit - m)
  int32_t* thr;      // [rp] last key each column sees
  uint16_t* stage;   // [2][16][d] key rows that are not one run of a page
};

// Floats of the scratch for `rows` columns (carved from `base` into `out` when given), parts
// 64-byte aligned relative to base.
static int64_t amx_chunk_layout(const ChunkArgs& a, int64_t rows, float* base,
                                ChunkAmxScratch* out) {
  const int64_t rp = chunk_lanes(rows), d = a.head_dim;
  const int64_t sizes[12] = {16, d / 2 * rp, rp * d, rp * 32, 256, 256, 16 * d, rp * d, rp, rp,
                             rp, 16 * d};
  float* parts[12];
  const int64_t used = carve_scratch(base, sizes, 12, parts);
  if (out != nullptr)
    *out = {reinterpret_cast<TileConfig*>(parts[0]), reinterpret_cast<uint32_t*>(parts[1]),
            parts[2], parts[3], reinterpret_cast<uint32_t*>(parts[4]),
            reinterpret_cast<uint32_t*>(parts[5]), reinterpret_cast<uint32_t*>(parts[6]),
            parts[7], parts[8], parts[9], reinterpret_cast<int32_t*>(parts[10]),
            reinterpret_cast<uint16_t*>(parts[11])};
  return used;
}

static int64_t amx_chunk_scratch(const ChunkArgs& a, int64_t rows) {
  return amx_chunk_layout(a, rows < kAmxChunkCols ? rows : kAmxChunkCols, nullptr, nullptr) + 16;
}

// Rows of keys [j, j + 16) of the tile as 16 rows head_dim apart: in place when they are
// consecutive rows of one page, else copied into stage, zero past the tile's last key.
static const uint16_t* amx_key_rows(const ChunkTile<uint16_t>& t, int64_t j, int64_t d,
                                    uint16_t* stage) {
  const int64_t n = t.n - j < 16 ? t.n - j : 16;
  if (n == 16 && bf16_keys_run(t, j, 16, d)) return t.k[j];
  for (int64_t i = 0; i < n; ++i) __builtin_memcpy(stage + i * d, t.k[j + i], d * 2);
  __builtin_memset(stage + n * d, 0, (16 - n) * d * 2);
  return stage;
}

// Base-2 logits of the tile's keys for every column tile into w.s.
static void amx_chunk_logits(const ChunkArgs& a, const ChunkTile<uint16_t>& t, int64_t rp,
                             const ChunkAmxScratch& w, ChunkLines& ahead) {
  const int64_t d = a.head_dim, chunks = d / 32, stride = d * 2;
  const bool two = t.n > 16;
  const uint16_t* k0 = amx_key_rows(t, 0, d, w.stage);
  const uint16_t* k1 = two ? amx_key_rows(t, 16, d, w.stage + 16 * d) : nullptr;
  for (int64_t ct = 0; ct < rp / 16; ++ct) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(4, w.qp + c * 16 * rp + ct * 16, 4 * rp);
      _tile_loadd(2, k0 + c * 32, stride);
      _tile_dpbf16ps(0, 2, 4);
      if (two) {
        _tile_loadd(3, k1 + c * 32, stride);
        _tile_dpbf16ps(1, 3, 4);
      }
    }
    _tile_stored(0, w.s + ct * 512, 64);
    if (two) _tile_stored(1, w.s + ct * 512 + 256, 64);
    ahead.step();
  }
}

// Probabilities exp2(s - m) of keys [0, 32) of one column tile's logits s [32][16] as bf16
// pairs pp [16][16] (word c of pair i: keys 2i, 2i + 1 of column c, the first in the low half);
// kMasked: 0 for keys past n and keys a column does not see. Returns the columns' sums.
template <bool kMasked>
static inline __m512 amx_chunk_probabilities(const float* s, __m512 m, int64_t n, int64_t j0,
                                             __m512i thr, __m512i reach, uint32_t* pp) {
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  for (int64_t k = 0; k < 32; k += 2) {
    __m512 p0 = fast_exp2(_mm512_sub_ps(_mm512_loadu_ps(s + k * 16), m));
    __m512 p1 = fast_exp2(_mm512_sub_ps(_mm512_loadu_ps(s + (k + 1) * 16), m));
    if (kMasked) {  // masked logits may be anything, stale ones included: their exp2 is dropped
      p0 = _mm512_maskz_mov_ps(k < n ? visible_keys(thr, reach, j0 + k) : 0, p0);
      p1 = _mm512_maskz_mov_ps(k + 1 < n ? visible_keys(thr, reach, j0 + k + 1) : 0, p1);
    }
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
    _mm512_storeu_si512(pp + k * 8, bf16_pair_words(p0, p1));
  }
  return _mm512_add_ps(sum0, sum1);
}

// The columns' max of the logits of the keys they see among [0, n).
static inline __m512 amx_chunk_max(const float* s, int64_t n, int64_t j0, __m512i thr,
                                   __m512i reach) {
  __m512 mx[2] = {_mm512_set1_ps(kNegInf), _mm512_set1_ps(kNegInf)};
  for (int64_t k = 0; k < n; ++k)
    mx[k % 2] = _mm512_mask_max_ps(mx[k % 2], visible_keys(thr, reach, j0 + k), mx[k % 2],
                                   _mm512_loadu_ps(s + k * 16));
  return _mm512_max_ps(mx[0], mx[1]);
}

// Online softmax of column tile ct over the tile's logits (see lazy_softmax.h: the block is
// exponentiated against the reference max when every column has one and the block's sums stay
// within kLazySum, else the max moves first). Writes the probability pairs to w.pp and returns
// each column's rescale factor of O.
template <bool kMasked>
static __m512 amx_chunk_softmax(int64_t ct, int64_t n, int64_t j0, __m512i reach,
                                const ChunkAmxScratch& w) {
  const float* s = w.s + ct * 512;
  const __m512i thr = _mm512_loadu_si512(w.thr + ct * 16);
  const __m512 m_old = _mm512_loadu_ps(w.m + ct * 16), l = _mm512_loadu_ps(w.l + ct * 16);
  const __m512 one = _mm512_set1_ps(1.0f);
  if (_mm512_cmp_ps_mask(m_old, _mm512_set1_ps(kNoMax), _CMP_EQ_OQ) == 0) {
    const __m512 sum = amx_chunk_probabilities<kMasked>(s, m_old, n, j0, thr, reach, w.pp);
    if (_mm512_cmp_ps_mask(sum, _mm512_set1_ps(kLazySum), _CMP_LE_OQ) == 0xffff) {
      _mm512_storeu_ps(w.l + ct * 16, _mm512_add_ps(l, sum));
      return one;
    }
  }
  const __m512 m_new = _mm512_max_ps(m_old, amx_chunk_max(s, n, j0, thr, reach));
  const __m512 alpha = (__m512)vexp2((vf)_mm512_sub_ps(m_old, m_new));  // 0 on a first key
  const __m512 sum = amx_chunk_probabilities<true>(s, m_new, n, j0, thr, reach, w.pp);
  _mm512_storeu_ps(w.l + ct * 16, _mm512_fmadd_ps(l, alpha, sum));
  _mm512_storeu_ps(w.m + ct * 16, m_new);
  return alpha;
}

// dst[c][i] = src[i][c] for a 16 x 16 matrix of 32-bit words: interleaves of 32- and 64-bit
// elements within 128-bit lanes, then two rounds of 128-bit lane shuffles.
static inline void transpose_words_16x16(const uint32_t* src, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + 16 * i);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i + 3
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // column 4L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512i lo0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
    const __m512i lo1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i hi0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
    const __m512i hi1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
    _mm512_storeu_si512(dst + 16 * j, _mm512_shuffle_i32x4(lo0, lo1, 0x88));
    _mm512_storeu_si512(dst + 16 * (4 + j), _mm512_shuffle_i32x4(lo0, lo1, 0xdd));
    _mm512_storeu_si512(dst + 16 * (8 + j), _mm512_shuffle_i32x4(hi0, hi1, 0x88));
    _mm512_storeu_si512(dst + 16 * (12 + j), _mm512_shuffle_i32x4(hi0, hi1, 0xdd));
  }
}

// O rows of column tile ct times alpha (only where the max moved), then O += P . V.
static void amx_chunk_values(int64_t ct, int64_t d, __m512 alpha, const ChunkAmxScratch& w,
                             ChunkLines& ahead) {
  float* o = w.o + ct * 16 * d;
  const __mmask16 moved = _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ);
  if (moved != 0) {
    float al[16];
    _mm512_storeu_ps(al, alpha);
    for (int c = 0; c < 16; ++c)
      if ((moved >> c) & 1)
        for (int64_t e = 0; e < d; e += 16)
          _mm512_storeu_ps(o + c * d + e,
                           _mm512_mul_ps(_mm512_loadu_ps(o + c * d + e), _mm512_set1_ps(al[c])));
  }
  transpose_words_16x16(w.pp, w.pa);
  _tile_loadd(6, w.pa, 64);
  for (int64_t e0 = 0; e0 < d; e0 += 32) {
    _tile_loadd(0, o + e0, 4 * d);
    _tile_loadd(1, o + e0 + 16, 4 * d);
    _tile_loadd(2, w.vp + e0, 4 * d);
    _tile_dpbf16ps(0, 6, 2);
    _tile_loadd(3, w.vp + e0 + 16, 4 * d);
    _tile_dpbf16ps(1, 6, 3);
    _tile_stored(0, o + e0, 4 * d);
    _tile_stored(1, o + e0 + 16, 4 * d);
    ahead.step();
  }
}

static void chunk_item_amx(const ChunkArgs& a, const ChunkItem& it, float* scratch,
                           float* states) {
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t rows = group * it.num_rows, rp = chunk_lanes(rows);
  ChunkAmxScratch w;
  amx_chunk_layout(a, rows, scratch + (16 - (reinterpret_cast<uintptr_t>(scratch) / 4) % 16) % 16,
                   &w);
  bf16_load_queries(a, it, rp, w.qf, w.qp);
  const int64_t first = a.num_cached[it.b] + it.row0;
  for (int64_t c = 0; c < rp; ++c) {  // padding columns see what the last row sees
    w.thr[c] = (int32_t)(first + (c < rows ? c % it.num_rows : it.num_rows - 1));
    w.m[c] = kNoMax;
    w.l[c] = 0.0f;
  }
  __builtin_memset(w.o, 0, rp * d * sizeof(float));
  const int32_t reach_keys = a.window > 0 ? (int32_t)(a.window - 1) : (int32_t)(1 << 30);
  const __m512i reach = _mm512_set1_epi32(reach_keys);
  const int32_t low = (int32_t)first, high = (int32_t)(first + it.num_rows - 1);
  const PairIndex index;
  configure_full_tiles(w.cfg);
  const int64_t steps = rp / 16 * (1 + d / 32);  // the step() calls of one tile
  // an odd last key gets a partner (key 0's rows), whose probability is 0
  chunk_each_tile<uint16_t>(a, it, true, steps,
                            [&](int64_t j0, const ChunkTile<uint16_t>& t, ChunkLines& ahead) {
    const int64_t n = t.n, pairs = (n + 1) / 2;
    amx_chunk_logits(a, t, rp, w, ahead);
    bf16_value_pairs(t, pairs, d, index, w.vp);
    if (pairs < 16) __builtin_memset(w.vp + pairs * d, 0, (16 - pairs) * d * 4);  // no stale NaN
    // every column sees every key of the tile (columns' thresholds lie in [low, high])
    const bool all = n == 32 && j0 + n - 1 <= low && j0 >= (int64_t)high - reach_keys;
    for (int64_t ct = 0; ct < rp / 16; ++ct) {
      const __m512 alpha = all ? amx_chunk_softmax<false>(ct, n, j0, reach, w)
                               : amx_chunk_softmax<true>(ct, n, j0, reach, w);
      amx_chunk_values(ct, d, alpha, w, ahead);
    }
  });
  _tile_release();  // no tile state left behind for context switches to save
  float* st = states + it.state;  // max [rp], sum [rp], acc [d][rp] in chunk order
  for (int64_t c = 0; c < rp; ++c) {
    st[c] = w.l[c] > 0.0f ? w.m[c] : kNegInf;
    st[rp + c] = w.l[c];
    for (int64_t e = 0; e < d; ++e) st[(2 + chunk_pos<uint16_t>(e)) * rp + c] = w.o[c * d + e];
  }
}
