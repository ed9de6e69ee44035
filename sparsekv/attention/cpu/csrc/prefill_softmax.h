// The online softmax of the causal prefill (flash) kernels that hold logits and outputs
// transposed, keys (or output dims) along rows and 16 query columns along the lanes of an
// AVX-512 vector: their scratch layout, query packing, lazy-max softmax, output rescale and
// final write (included by the AMX unit before prefill_amx.h, and by the AVX512-BF16 unit
// before prefill_bf16.h; interface in prefill.h). The two kernels differ only in how they
// compute the logits S^T = K Q^T and the value product O^T += V^T P of a key block.
//
// A column is (query head h of the item's GQA group, query row r), col = h * BQ + r; a column
// tile is 16 columns. A query's softmax runs down a column: the running max, the sum and the
// rescaling of O^T are lane-wise vector operations on 16 queries at once, with no horizontal
// reduction anywhere. Probabilities are rounded to bf16 for the value product; the denominator
// sums them unrounded in fp32. Logits are in base 2 (log2(e) folded into the scale).
//
// Needs a TileConfig type (amx_util.h; a declaration is enough where no tile is used) and
// kernel_impl.h's vector helpers (vexp2, kNegInf, kLog2e, kLn2).
#include "lazy_softmax.h"

constexpr int64_t kPKeys = kPrefillKeyBlock;   // keys per block (a multiple of 32)
constexpr int64_t kPMaxTiles = 64;             // column tiles per item (group x query block)
constexpr int64_t kPairChunk = 32;             // query elements per 16 packed pairs

// Scratch of one item; columns are (head h of the group, query row r): col = h * BQ + r.
struct PrefillScratch {
  TileConfig* cfg;
  uint32_t* qpairs;  // [tiles][d / 32][16 pairs][16 columns] query element pairs (int8
                     // Q·K^T: [tiles][d / 4][16 columns] words of four codes)
  float* s;          // [tiles][kPKeys][16 columns] logits of the current key block
  uint32_t* p;       // [tiles][kPKeys / 32][16 key pairs][16 columns] bf16 probabilities
  float* o;          // [tiles][d][16 columns] unnormalised output, transposed
  float* m;          // [cols] running max of the base-2 logits (kNoMax before any key)
  float* l;          // [cols] running sum of exp2(logit - m)
  int32_t* thr;      // [cols] last key index the column sees
  float* qscale;     // [cols] int8 query scales (prefill_qk8.h only)
  int32_t* qcorr;    // [cols] 128 x the column's int8 code sum (prefill_qk8.h only)
  float* qshift;     // [cols] the query's dot product with the key means (prefill_qk8.h only)
};


// How far below its last visible key (thr) a column sees: window - 1 with a sliding window,
// otherwise 2^30 (more than any key index, so every key up to thr is visible).
static int32_t window_reach(const PrefillArgs& a) {
  return a.window > 0 ? (int32_t)(a.window - 1) : (int32_t)(1 << 30);
}


static int64_t prefill_columns(const PrefillArgs& a) {
  return a.num_heads / a.num_kv_heads * a.query_block;
}

// Floats of PrefillScratch (carved from `base` into `out` when given), parts 64-byte aligned
// relative to base.
static int64_t prefill_layout(const PrefillArgs& a, float* base, PrefillScratch* out) {
  const int64_t cols = prefill_columns(a), d = a.head_dim;
  const int64_t sizes[11] = {16,   cols * d / 2, kPKeys * cols, cols * kPKeys / 2,
                             d * cols, cols,   cols,          cols,
                             cols, cols,         cols};
  float* parts[11];
  const int64_t used = carve_scratch(base, sizes, 11, parts);
  if (out != nullptr)
    *out = {reinterpret_cast<TileConfig*>(parts[0]), reinterpret_cast<uint32_t*>(parts[1]),
            parts[2], reinterpret_cast<uint32_t*>(parts[3]), parts[4], parts[5], parts[6],
            reinterpret_cast<int32_t*>(parts[7]), parts[8], reinterpret_cast<int32_t*>(parts[9]),
            parts[10]};
  return used;
}


// Query pairs of the item's columns (zero past nq) and each column's last visible key.
static void pack_queries(const PrefillArgs& a, int64_t kvh, int64_t q0,
                         const PrefillScratch& w) {
  const int64_t G = a.num_heads / a.num_kv_heads, BQ = a.query_block, half = a.head_dim / 2;
  const int64_t chunks = a.head_dim / kPairChunk;
  const uint16_t* q = a.query;
  for (int64_t h = 0; h < G; ++h)
    for (int64_t r = 0; r < BQ; ++r) {
      const int64_t col = h * BQ + r, row = q0 + r;
      // Padding columns see every key: their logits (zero) stay finite, and are never written.
      w.thr[col] = (int32_t)(row < a.nq ? a.nk - a.nq + row : a.nk - 1);
      uint32_t* dst = w.qpairs + col / 16 * chunks * 256 + col % 16;
      const uint16_t* src =
          row < a.nq ? q + (kvh * G + h) * a.query_head_stride + row * a.query_row_stride : nullptr;
      for (int64_t e = 0; e < half; ++e) {  // element pairs as 32-bit words
        uint32_t pair = 0;
        if (src != nullptr) __builtin_memcpy(&pair, src + 2 * e, 4);
        dst[e / 16 * 256 + e % 16 * 16] = pair;
      }
    }
}


// s * sc - m given neg_m = -m: fused (the product unrounded), or with the product rounded
// first. The embedded-rounding multiply is a builtin, so -ffp-contract=fast cannot fuse it back.
template <bool kRounded>
static inline __m512 scaled_minus_max(__m512 s, __m512 sc, __m512 neg_m) {
  if (kRounded)
    return _mm512_add_ps(_mm512_mul_round_ps(s, sc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                         neg_m);
  return _mm512_fmadd_ps(s, sc, neg_m);
}

// Base-2 logits from this magnitude up (2^14) have a unit in the last place of 2^-9 or more,
// bf16's own rounding of the probabilities: there the fused product's rounding error would
// move the exponent visibly, and near 2^31 (logit gaps of ~1e9) overflow exp2 into inf / 0 and
// the row into NaN. No model's logits come near; finite inputs can.
constexpr float kRoundedLogits = 16384.0f;

// True if some column's reference max m (ignoring columns still at kNoMax) needs the rounded
// products of block_probabilities.
static inline bool needs_rounded_logits(__m512 m) {
  const __mmask16 seen = _mm512_cmp_ps_mask(m, _mm512_set1_ps(kNoMax), _CMP_NEQ_OQ);
  return _mm512_mask_cmp_ps_mask(seen, _mm512_abs_ps(m), _mm512_set1_ps(kRoundedLogits),
                                 _CMP_GE_OQ) != 0;
}

// Probabilities of a block's logits against the reference max m of each column:
// p = exp2(s * scale2 - m) for keys k0 + [0, kPKeys), 0 for keys a column does not see
// (kMasked), written as the bf16 pairs of tile t (see below). Returns the columns' sums of
// the unrounded p.
//
// kRounded: s * scale2 rounded to fp32 before m is subtracted, as m itself was rounded (see
// needs_rounded_logits); otherwise one fused multiply-add, whose unrounded product differs from
// the rounded max by up to half a unit in the last place of m.
template <bool kMasked, bool kRounded>
static inline __m512 block_probabilities(int64_t k0, int t, __m512 m, float scale2,
                                         int32_t reach, const PrefillScratch& w) {
  const float* s = w.s + t * kPKeys * 16;
  const __m512i thr = _mm512_loadu_si512(w.thr + t * 16);
  const __m512i reach_v = _mm512_set1_epi32(reach);
  const __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m), sc = _mm512_set1_ps(scale2);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  uint32_t* p = w.p + t * (kPKeys / 32) * 256;
  for (int64_t k = 0; k < kPKeys; k += 2) {
    __m512 p0 = fast_exp2(scaled_minus_max<kRounded>(_mm512_loadu_ps(s + k * 16), sc, neg_m));
    __m512 p1 =
        fast_exp2(scaled_minus_max<kRounded>(_mm512_loadu_ps(s + (k + 1) * 16), sc, neg_m));
    if (kMasked) {  // masked logits may be anything finite: their exp2 is dropped, inf included
      p0 = _mm512_maskz_mov_ps(visible_keys(thr, reach_v, k0 + k), p0);
      p1 = _mm512_maskz_mov_ps(visible_keys(thr, reach_v, k0 + k + 1), p1);
    }
    sum0 = _mm512_add_ps(sum0, p0);
    sum1 = _mm512_add_ps(sum1, p1);
    // (p[k], p[k + 1]) of each column as one word: the pair order of a B tile
    _mm512_storeu_si512(p + k * 8, bf16_pair_words(p0, p1));
  }
  return _mm512_add_ps(sum0, sum1);
}

// The probabilities of block_probabilities, with rounded products where m needs them.
template <bool kMasked>
static inline __m512 block_probabilities_for(int64_t k0, int t, __m512 m, float scale2,
                                             int32_t reach, const PrefillScratch& w) {
  if (needs_rounded_logits(m)) return block_probabilities<kMasked, true>(k0, t, m, scale2, reach, w);
  return block_probabilities<kMasked, false>(k0, t, m, scale2, reach, w);
}

// The columns' max of the block's base-2 logits (times scale2), over the keys they see.
static inline __m512 block_max(int64_t k0, int t, bool masked, float scale2, int32_t reach,
                               const PrefillScratch& w) {
  const float* s = w.s + t * kPKeys * 16;
  const __m512i thr = _mm512_loadu_si512(w.thr + t * 16);
  const __m512i reach_v = _mm512_set1_epi32(reach);
  // Four chains, as vmaxps has a 4-cycle latency.
  __m512 mx[4];
  for (int j = 0; j < 4; ++j) mx[j] = _mm512_set1_ps(kNegInf);
  if (!masked) {
    for (int64_t k = 0; k < kPKeys; k += 4)
      for (int j = 0; j < 4; ++j) mx[j] = _mm512_max_ps(mx[j], _mm512_loadu_ps(s + (k + j) * 16));
  } else {
    for (int64_t k = 0; k < kPKeys; k += 4)
      for (int j = 0; j < 4; ++j) {
        const __mmask16 see = visible_keys(thr, reach_v, k0 + k + j);
        mx[j] = _mm512_mask_max_ps(mx[j], see, mx[j], _mm512_loadu_ps(s + (k + j) * 16));
      }
  }
  const __m512 mx_all = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
  return _mm512_mul_ps(mx_all, _mm512_set1_ps(scale2));
}


// Online softmax of column tile t over the block's logits: updates m and l, writes the bf16
// probability pairs and returns alpha = exp2(m_old - m_new) per column. kMasked: the block
// crosses the tile's diagonal or its window's lower edge; keys a column does not see (past its
// threshold, or `reach` or more below it) get probability 0.
//
// Lazy max: once every column has a max, the block is first exponentiated against it in one
// pass (no max pass, no rescale of O). The reference max need not be the running max:
// m + log2(l) is the same for any reference, it only has to keep the probabilities in range.
// If some column's block sum exceeds kLazySum (a logit more than ~8 above its max, an inf, a
// NaN), the block is redone the exact way: max pass, new max, alpha, probabilities. ~8% of the
// kernel. Numerics: the largest probability of a row is no longer exactly 1, so its bf16
// rounding (2^-9 relative) reaches the output too, as every other probability's does (against
// fp32: mean output error +5 to +14%, max 8.6e-3 -> 1.5e-2 on peaked rows with 9 heads x 600
// tokens); lse is unaffected.
//
// noinline: inlined into prefill_item_amx, GCC kept a running sum on the stack (a store-load
// chain through the exp loop).
template <bool kMasked>
static __attribute__((noinline)) __m512 block_softmax(int64_t k0, int t, float scale2,
                                                      int32_t reach, const PrefillScratch& w) {
  const __m512 m_old = _mm512_loadu_ps(w.m + t * 16), l = _mm512_loadu_ps(w.l + t * 16);
  const __m512 one = _mm512_set1_ps(1.0f);
  if (_mm512_cmp_ps_mask(m_old, _mm512_set1_ps(kNoMax), _CMP_EQ_OQ) == 0) {
    const __m512 sum = block_probabilities_for<kMasked>(k0, t, m_old, scale2, reach, w);
    if (_mm512_cmp_ps_mask(sum, _mm512_set1_ps(kLazySum), _CMP_LE_OQ) == 0xffff) {
      _mm512_storeu_ps(w.l + t * 16, _mm512_add_ps(l, sum));
      return one;
    }
  }
  const __m512 m_new = _mm512_max_ps(m_old, block_max(k0, t, kMasked, scale2, reach, w));
  // alpha by the accurate vexp2 (2e-7 relative; exactly 0 for a column's first visible block,
  // m_old = kNoMax): its error would add up in l over a row's rescales, and l gives the lse.
  const __m512 alpha = vexp2(_mm512_sub_ps(m_old, m_new));
  const __m512 sum = block_probabilities_for<kMasked>(k0, t, m_new, scale2, reach, w);
  _mm512_storeu_ps(w.l + t * 16, _mm512_fmadd_ps(l, alpha, sum));
  _mm512_storeu_ps(w.m + t * 16, m_new);
  return alpha;
}

// O^T columns of tile t times alpha, skipped when the max did not move (alpha all 1, the
// common case once a few blocks are in).
static void rescale_output(__m512 alpha, int t, int64_t d, const PrefillScratch& w) {
  if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) == 0) return;
  float* o = w.o + t * d * 16;
  for (int64_t e = 0; e < d; ++e)
    _mm512_storeu_ps(o + e * 16, _mm512_mul_ps(_mm512_loadu_ps(o + e * 16), alpha));
}

// out = O / l (bf16, rounded to nearest even) and lse = (m + log2 l) * ln 2 of the item's rows.
static void write_rows(const PrefillArgs& a, int64_t kvh, int64_t q0, int64_t rows, int64_t cols,
                       const PrefillScratch& w) {
  const int64_t G = a.num_heads / a.num_kv_heads, BQ = a.query_block, d = a.head_dim;
  float tile[16 * 16];
  for (int64_t h = 0; h < G; ++h) {
    const int64_t head = kvh * G + h;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int64_t col0 = h * BQ + r0, n = rows - r0 < 16 ? rows - r0 : 16;
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(w.l + col0));
      for (int64_t e0 = 0; e0 < d; e0 += 16) {
        // 16 dims x 16 rows of O^T, normalised, transposed through a small buffer.
        const float* o = w.o + (col0 / 16 * d + e0) * 16;
        for (int64_t e = 0; e < 16; ++e)
          _mm512_storeu_ps(tile + e * 16, _mm512_mul_ps(_mm512_loadu_ps(o + e * 16), inv));
        const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160,
                                                 176, 192, 208, 224, 240);
        for (int64_t r = 0; r < n; ++r) {
          const __m512 row = _mm512_i32gather_ps(column, tile + r, 4);
          uint16_t* dst = a.out + (head * a.nq + q0 + r0 + r) * d + e0;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(row));
        }
      }
      for (int64_t r = 0; r < n; ++r)
        a.lse[head * a.nq + q0 + r0 + r] =
            (w.m[col0 + r] + __builtin_log2f(w.l[col0 + r])) * kLn2;
    }
  }
}
