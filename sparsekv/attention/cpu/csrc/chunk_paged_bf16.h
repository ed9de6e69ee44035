// bf16 pages with AVX512-BF16 dot products (vdpbf16ps) for both products of the rows-in-lanes
// path (chunk_paged_impl.h): included there by the avx512_bf16 unit (SKV_CHUNK_BF16, 16 lanes).
//
// vdpbf16ps adds two bf16 products per fp32 lane, so a lane holds a pair of elements:
// - QK^T: query pairs (q[2p], q[2p+1]) of 16 rows in the lanes of qp[p], against the key's pair
//   p broadcast from the page (its bf16 row is already pair after pair): head_dim / 2
//   instructions per key and row vector instead of head_dim FMAs, and no widened copy of K.
// - PV: weight pairs (p[2i], p[2i+1]) of 16 rows against the pair (v[2i][e], v[2i + 1][e]) of
//   the tile's values interleaved once per tile (vp): half the instructions again.
// Queries and weights are rounded to bf16 (nearest even), as bf16 flash attention does; logits,
// the online softmax and every sum stay fp32. The item's state is the lanes path's (max, sum,
// accumulator in chunk order), so chunk_combine merges it unchanged.

static inline __m512 bf16_dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// 32 word indices: out word 2i <- word i, 2i + 1 <- word `second + i` (i < 16).
static inline __m512i interleave_index(int first, int second) {
  alignas(64) uint16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<uint16_t>(first + i);
    idx[2 * i + 1] = static_cast<uint16_t>(second + i);
  }
  return _mm512_load_si512(idx);
}

// The 4-byte word at p (a bf16 pair) broadcast to every lane.
static inline __m512i pair_splat(const uint16_t* p) {
  int32_t bits;
  __builtin_memcpy(&bits, p, 4);
  return _mm512_set1_epi32(bits);
}

// qp [d / 2][rp]: lane r of word p is row r's scaled query pair (2p, 2p + 1) in bf16; padding
// lanes 0. qf: scratch of rows * d floats.
static void bf16_load_queries(const ChunkArgs& a, const ChunkItem& it, int64_t rp, float* qf,
                              uint32_t* qp) {
  const int64_t d = a.head_dim, rows = a.num_heads / a.num_kv_heads * it.num_rows;
  chunk_scaled_queries<float>(a, it, qf, d, 1);  // natural element order
  for (int64_t p = 0; p < d / 2; ++p)
    for (int64_t r = 0; r < rp; ++r) {
      uint16_t pair[2] = {0, 0};  // low half: element 2p (little-endian words)
      if (r < rows) {
        from_float(qf[r * d + 2 * p], pair);
        from_float(qf[r * d + 2 * p + 1], pair + 1);
      }
      __builtin_memcpy(qp + p * rp + r, pair, 4);
    }
}

// s[j][R vectors] for KB keys, rows of R vectors of qp from lane c; key(j, p) points at key
// j's pair p (bf16 words 2p, 2p + 1), over `half` pairs.
template <int R, int KB, typename KeyPair>
static inline void bf16_qk_keys(KeyPair key, const uint32_t* qp, int64_t rp, int64_t half,
                                float* s) {
  __m512 acc[KB][R];
  for (int j = 0; j < KB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < half; ++p) {
    __m512i q[R];
    for (int r = 0; r < R; ++r) q[r] = _mm512_loadu_si512(qp + p * rp + r * 16);
    for (int j = 0; j < KB; ++j) {
      const __m512i k = pair_splat(key(j, p));
      for (int r = 0; r < R; ++r) acc[j][r] = bf16_dot(acc[j][r], q[r], k);
    }
  }
  for (int j = 0; j < KB; ++j)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + j * rp + r * 16, acc[j][r]);
}

// KB keys by their row pointers.
template <int R, int KB>
static inline void bf16_qk_block(const uint16_t* const* keys, const uint32_t* qp, int64_t rp,
                                 int64_t half, float* s) {
  bf16_qk_keys<R, KB>([keys](int j, int64_t p) { return keys[j] + 2 * p; }, qp, rp, half, s);
}

// KB keys that follow each other D elements apart from `base` (one page's run): every key pair
// is read at an immediate offset from one pointer, where KB key pointers would not fit in the
// registers beside the accumulators.
template <int R, int KB, int D>
static inline void bf16_qk_run(const uint16_t* base, const uint32_t* qp, int64_t rp, float* s) {
  bf16_qk_keys<R, KB>([base](int j, int64_t p) { return base + j * D + 2 * p; }, qp, rp, D / 2,
                      s);
}

// True when keys [j, j + count) of the tile lie one after another, `d` elements apart.
static inline bool bf16_keys_run(const ChunkTile<uint16_t>& t, int64_t j, int64_t count,
                                 int64_t d) {
  const uintptr_t first = (uintptr_t)t.k[j], row = (uintptr_t)(d * sizeof(uint16_t));
  for (int64_t i = 1; i < count; ++i)  // addresses as integers: no pointer past a buffer's end
    if ((uintptr_t)t.k[j + i] != first + (uintptr_t)i * row) return false;
  return true;
}

// Register block of R row vectors: KB keys of the logits, EB elements of the value sum (KB * R
// and EB * R accumulators: at most 16 of the 32 registers).
static constexpr int bf16_block(int r) { return r == 1 ? 16 : r == 2 ? 8 : 4; }

template <int R>
static void bf16_qk(const ChunkTile<uint16_t>& t, const uint32_t* qp, int64_t rp, int64_t d,
                    float* s, ChunkLines& lines) {
  constexpr int KB = bf16_block(R);
  int64_t j = 0;
  for (; j + KB <= t.n; j += KB) {
    if (d == 64 && bf16_keys_run(t, j, KB, 64))
      bf16_qk_run<R, KB, 64>(t.k[j], qp, rp, s + j * rp);
    else if (d == 128 && bf16_keys_run(t, j, KB, 128))
      bf16_qk_run<R, KB, 128>(t.k[j], qp, rp, s + j * rp);
    else
      bf16_qk_block<R, KB>(t.k + j, qp, rp, d / 2, s + j * rp);
    lines.step();
  }
  for (; j < t.n; ++j) bf16_qk_block<R, 1>(t.k + j, qp, rp, d / 2, s + j * rp);
}

// The word shuffles of the pair packing, built once per item.
struct PairIndex {
  __m512i values_lo = interleave_index(0, 32), values_hi = interleave_index(16, 48);
  __m512i weights = interleave_index(0, 16);
};

// vp [pairs][d]: word e of pair i is (v[2i][e], v[2i + 1][e]); pairs = padded / 2.
static void bf16_value_pairs(const ChunkTile<uint16_t>& t, int64_t pairs, int64_t d,
                             const PairIndex& index, uint32_t* vp) {
  const __m512i lo = index.values_lo, hi = index.values_hi;
  for (int64_t i = 0; i < pairs; ++i)
    for (int64_t e = 0; e < d; e += 32) {
      const __m512i x = _mm512_loadu_si512(t.v[2 * i] + e);
      const __m512i y = _mm512_loadu_si512(t.v[2 * i + 1] + e);
      _mm512_storeu_si512(vp + i * d + e, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(vp + i * d + e + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
}

// pp [pairs][rp]: lane r of word i is row r's weight pair (s[2i][r], s[2i + 1][r]) in bf16.
static void bf16_weight_pairs(const float* s, int64_t pairs, int64_t rp, const PairIndex& index,
                              uint32_t* pp) {
  const __m512i order = index.weights;
  for (int64_t i = 0; i < pairs; ++i)
    for (int64_t c = 0; c < rp; c += 16) {
      const __m512 even = _mm512_loadu_ps(s + 2 * i * rp + c);
      const __m512 odd = _mm512_loadu_ps(s + (2 * i + 1) * rp + c);
      const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [even | odd]
      _mm512_storeu_si512(pp + i * rp + c, _mm512_permutexvar_epi16(order, words));
    }
}

// acc (chunk order) = alpha * acc + sum_i pp[i] . vp[i] for natural elements [e0, e0 + EB) and
// R row vectors from lane c.
template <int R, int EB>
static inline void bf16_pv_block(const uint32_t* vp, const uint32_t* pp, int64_t pairs,
                                 const float* alpha, int64_t rp, int64_t d, int64_t e0,
                                 float* acc) {
  __m512 o[EB][R], al[R];
  for (int r = 0; r < R; ++r) al[r] = _mm512_loadu_ps(alpha + r * 16);
  for (int e = 0; e < EB; ++e)
    for (int r = 0; r < R; ++r)
      o[e][r] = _mm512_mul_ps(
          _mm512_loadu_ps(acc + chunk_pos<uint16_t>(e0 + e) * rp + r * 16), al[r]);
  for (int64_t i = 0; i < pairs; ++i) {
    __m512i w[R];
    for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_si512(pp + i * rp + r * 16);
    const uint32_t* v = vp + i * d + e0;
    for (int e = 0; e < EB; ++e) {
      const __m512i x = _mm512_set1_epi32(static_cast<int32_t>(v[e]));
      for (int r = 0; r < R; ++r) o[e][r] = bf16_dot(o[e][r], w[r], x);
    }
  }
  for (int e = 0; e < EB; ++e)
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(acc + chunk_pos<uint16_t>(e0 + e) * rp + r * 16, o[e][r]);
}

template <int R>
static void bf16_pv(const uint32_t* vp, const uint32_t* pp, int64_t pairs, const float* alpha,
                    int64_t rp, int64_t d, float* acc, ChunkLines& lines) {
  constexpr int EB = bf16_block(R);  // head_dim is a multiple of 32
  for (int64_t e0 = 0; e0 < d; e0 += EB) {
    bf16_pv_block<R, EB>(vp, pp, pairs, alpha, rp, d, e0, acc);
    lines.step();
  }
}

// Scratch floats of chunk_item_bf16 for `rows` rows.
static int64_t bf16_scratch(const ChunkArgs& a, int64_t rows) {
  const int64_t rp = chunk_lanes(rows), d = a.head_dim, tile = a.tile;
  // qp [d/2][rp], s [tile][rp], alpha [rp], pp [tile/2][rp], vp [tile/2][d], qf [rp][d]
  return rp * (d / 2 + tile + 1 + tile / 2) + tile / 2 * d + rp * d;
}

static void chunk_item_bf16(const ChunkArgs& a, const ChunkItem& it, float* scratch,
                            float* states) {
  const int64_t d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int64_t tile = a.tile, rows = group * it.num_rows, rp = chunk_lanes(rows);
  uint32_t* qp = (uint32_t*)scratch;          // [d / 2][rp]
  float* s = scratch + d / 2 * rp;            // [tile][rp]
  float* alpha = s + tile * rp;               // [rp]
  uint32_t* pp = (uint32_t*)(alpha + rp);     // [tile / 2][rp]
  uint32_t* vp = pp + tile / 2 * rp;          // [tile / 2][d]
  float* qf = (float*)(vp + tile / 2 * d);    // [rp][d]
  float* st = states + it.state;              // max [rp], sum [rp], acc [d][rp]
  bf16_load_queries(a, it, rp, qf, qp);
  chunk_reset_state(rp, d, st);
  const PairIndex index;
  // the register blocks of a tile (bf16_qk and bf16_pv over every row pass): the step() calls
  // that spread the next tile's prefetches, so that none is left for the burst of finish()
  int64_t steps = 0;
  for (int64_t c = 0; c < rp; c += 4 * W) {  // the passes of SKV_CHUNK_ROW_PASSES
    const int r = chunk_pass_vectors(rp, c);
    steps += tile / bf16_block(r) + d / bf16_block(r);
  }
  // an odd last key gets a partner (key 0's rows) whose weight is set to 0
  chunk_each_tile<uint16_t>(a, it, true, steps,
                            [&](int64_t j0, const ChunkTile<uint16_t>& t, ChunkLines& ahead) {
    const int64_t n = t.n, pairs = (n + 1) / 2;
#define SKV_QK(R) bf16_qk<R>(t, qp + c, rp, d, s + c, ahead)
    SKV_CHUNK_ROW_PASSES(rp, SKV_QK)
#undef SKV_QK
    chunk_softmax(a, it, rows, rp, j0, n, s, st, alpha);
    if (n % 2)
      for (int64_t r = 0; r < rp; ++r) s[n * rp + r] = 0.0f;
    bf16_value_pairs(t, pairs, d, index, vp);
    bf16_weight_pairs(s, pairs, rp, index, pp);
#define SKV_PV(R) bf16_pv<R>(vp, pp + c, pairs, alpha + c, rp, d, st + 2 * rp + c, ahead)
    SKV_CHUNK_ROW_PASSES(rp, SKV_PV)
#undef SKV_PV
  });
}
