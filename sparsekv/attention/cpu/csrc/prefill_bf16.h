// Causal prefill (flash) attention with AVX512-BF16 dot products (vdpbf16ps), bf16 in, fp32
// accumulation, for AVX-512 CPUs without AMX (AMD Zen 4, Intel Cooper Lake); included by
// isa_avx512_bf16.cpp after prefill_softmax.h, interface in prefill.h.
//
// The same algorithm and scratch as the AMX kernel (prefill_amx.h): one work item is a block
// of query rows of every query head of one KV head, computed transposed with 16 query columns
// along the lanes, key blocks of kPKeys, the lazy-max online softmax of prefill_softmax.h. Only
// the two products differ: each vdpbf16ps multiplies one broadcast bf16 pair of a key (or of
// two keys' values) with the 16 columns' pairs and adds both products to 16 fp32 lanes,
//   S^T[key][16 cols]  += dot(K[key][2e, 2e + 1], Qpairs[e][16 cols])       for e < d / 2
//   O^T[dim][16 cols]  += dot((V[2p][dim], V[2p + 1][dim]), Ppairs[p][16 cols])  for p < 32
// in register blocks of NR rows (keys or dims) by NC column tiles (NR * NC accumulators, one
// load of each column tile's pairs and one broadcast per row each step), so that the
// dot-product unit, not the loads, sets the pace. The binding hands the kernel the keys as
// rows of head_dim bf16 (the pairs of a key are its 32-bit words) and the values with the
// rows of two keys interleaved (prefill.h).
//
// Cost on Zen 4 (one vdpbf16ps on 512 bits per cycle, 64 FLOP): the products of a block are
// 2 * kPKeys * cols * d / 2 instructions; the softmax adds about 10% (see bench kernels).

// Columns tiles of one register block, and its rows (keys or dims): NR * NC accumulators in
// at most 24 of the 32 vector registers, the rest for the column pairs and a broadcast.
template <int NC>
struct DpBlock {
  static constexpr int kRows = NC == 1 ? 16 : NC == 4 ? 4 : 8;
};

// Logits of keys [k0 + k, k0 + k + NR) of the NC column tiles `t` into w.s.
template <int NC>
static inline void logits_block(const PrefillArgs& a, const uint32_t* K, int64_t key,
                                const int* t, const PrefillScratch& w) {
  constexpr int NR = DpBlock<NC>::kRows;
  const int64_t half = a.head_dim / 2;
  __m512 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint32_t* qp[NC];
  for (int c = 0; c < NC; ++c) qp[c] = w.qpairs + t[c] * half * 16;
  const uint32_t* krow = K + key * half;
  for (int64_t e = 0; e < half; ++e) {
    __m512bh q[NC];
    for (int c = 0; c < NC; ++c) q[c] = (__m512bh)_mm512_loadu_si512(qp[c] + e * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512bh k = (__m512bh)_mm512_set1_epi32((int)krow[r * half + e]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], k, q[c]);
    }
  }
  const int64_t k = key % kPKeys;
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(w.s + (t[c] * kPKeys + k + r) * 16, acc[r][c]);
}

// O^T[dims e0 + [0, NR)] of the NC column tiles `t` += the block's values times probabilities.
template <int NC>
static inline void values_block(const PrefillArgs& a, const uint32_t* Vp, int64_t k0, int64_t e0,
                                const int* t, const PrefillScratch& w) {
  constexpr int NR = DpBlock<NC>::kRows;
  const int64_t d = a.head_dim;
  __m512 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_loadu_ps(w.o + (t[c] * d + e0 + r) * 16);
  const uint32_t* pp[NC];
  for (int c = 0; c < NC; ++c) pp[c] = w.p + t[c] * (kPKeys / 32) * 256;
  const uint32_t* vrow = Vp + k0 / 2 * d + e0;
  for (int64_t p = 0; p < kPKeys / 2; ++p) {
    __m512bh pr[NC];
    for (int c = 0; c < NC; ++c) pr[c] = (__m512bh)_mm512_loadu_si512(pp[c] + p * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512bh v = (__m512bh)_mm512_set1_epi32((int)vrow[p * d + r]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v, pr[c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(w.o + (t[c] * d + e0 + r) * 16, acc[r][c]);
}

// Both products of key block k0 for NC column tiles.
template <int NC>
static void block_products(bool values, const PrefillArgs& a, const uint32_t* K,
                           const uint32_t* Vp, int64_t k0, const int* t, const PrefillScratch& w) {
  constexpr int NR = DpBlock<NC>::kRows;
  if (!values) {
    for (int64_t k = 0; k < kPKeys; k += NR) logits_block<NC>(a, K, k0 + k, t, w);
  } else {
    for (int64_t e0 = 0; e0 < a.head_dim; e0 += NR) values_block<NC>(a, Vp, k0, e0, t, w);
  }
}

// Column tiles per register block, as a type: ColTiles<NC>::value.
template <int NC>
struct ColTiles {
  static constexpr int value = NC;
};

// run(ColTiles<NC>{}, tiles + i) over the listed column tiles in register blocks of three
// (four where that leaves no single tile: one broadcast then serves more columns).
template <typename Run>
static inline void for_tile_groups(const int* tiles, int nt, const Run& run) {
  int i = 0;
  while (i < nt) {
    const int left = nt - i;
    if (left == 4 || left >= 7) {
      run(ColTiles<4>{}, tiles + i);
      i += 4;
    } else if (left >= 3) {
      run(ColTiles<3>{}, tiles + i);
      i += 3;
    } else if (left == 2) {
      run(ColTiles<2>{}, tiles + i);
      i += 2;
    } else {
      run(ColTiles<1>{}, tiles + i);
      i += 1;
    }
  }
}

// One product (logits, or values) of key block k0 for the listed column tiles.
static void block_products_all(bool values, const PrefillArgs& a, const uint32_t* K,
                               const uint32_t* Vp, int64_t k0, const int* tiles, int nt,
                               const PrefillScratch& w) {
  for_tile_groups(tiles, nt, [&](auto cols, const int* t) {
    block_products<decltype(cols)::value>(values, a, K, Vp, k0, t, w);
  });
}

static int64_t prefill_scratch_bf16(const PrefillArgs& a) {
  return prefill_layout(a, nullptr, nullptr) + 16;  // + 16: room to align the base
}

// bf16 x 16 -> fp32 (the bf16 bits are the high half of an fp32).
static inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Attention of query block qb of KV head kvh's group, with the queries packed by `pack` and
// each key block's logits computed by `logits(k0, tiles, nt, w)` (the bf16 products here, the
// int8 ones of prefill_qk8.h); the value product, softmax and write as prefill_item_amx.
// shift_lse: the logits lack w.qshift (smoothed keys), which the lse gets back.
template <typename Logits, typename Pack>
static void prefill_item_bf16_with(const PrefillArgs& a, int64_t kvh, int64_t qb, float* scratch,
                                   const Logits& logits, const Pack& pack, bool shift_lse) {
  PrefillScratch w;
  prefill_layout(a, scratch + (16 - (reinterpret_cast<uintptr_t>(scratch) / 4) % 16) % 16, &w);
  const int64_t cols = prefill_columns(a), ntiles = cols / 16, d = a.head_dim;
  const int64_t q0 = qb * a.query_block;
  const int64_t rows = a.nq - q0 < a.query_block ? a.nq - q0 : a.query_block;
  pack(a, kvh, q0, w);
  for (int64_t c = 0; c < cols; ++c) {
    w.m[c] = kNoMax;
    w.l[c] = 0.0f;
  }
  __builtin_memset(w.o, 0, d * cols * sizeof(float));
  const uint32_t* Vp = reinterpret_cast<const uint32_t*>(a.value_t + kvh * a.nkp * d);
  const float scale2 = a.scale * kLog2e;
  const int64_t last_key = a.nk - a.nq + q0 + rows - 1;
  const int32_t reach = window_reach(a);
  const int64_t first_key = a.nk - a.nq + q0 - reach;
  const int64_t first_block = first_key > 0 ? first_key / kPKeys * kPKeys : 0;
  for (int64_t k0 = first_block; k0 <= last_key; k0 += kPKeys) {
    int tiles[kPMaxTiles];
    bool masked[kPMaxTiles];
    int nt = 0;
    for (int t = 0; t < ntiles; ++t) {
      const int64_t low = w.thr[t * 16], high = w.thr[t * 16 + 15];
      if (k0 > high || k0 + kPKeys - 1 < low - reach) continue;
      masked[nt] = k0 + kPKeys - 1 > low || k0 < high - reach;
      tiles[nt++] = t;
    }
    logits(k0, tiles, nt, w);
    for (int i = 0; i < nt; ++i)
      rescale_output(masked[i] ? block_softmax<true>(k0, tiles[i], scale2, reach, w)
                               : block_softmax<false>(k0, tiles[i], scale2, reach, w),
                     tiles[i], d, w);
    block_products_all(true, a, nullptr, Vp, k0, tiles, nt, w);
  }
  if (shift_lse)
    for (int64_t c = 0; c < cols; ++c) w.m[c] += w.qshift[c] * scale2;
  write_rows(a, kvh, q0, rows, cols, w);
}

// Attention of query block qb of KV head kvh's group (PrefillKernel::item); as
// prefill_item_amx, with the products above.
static void prefill_item_bf16(const PrefillArgs& a, int64_t kvh, int64_t qb, float* scratch) {
  const uint32_t* K = reinterpret_cast<const uint32_t*>(a.key + kvh * a.nkp * a.head_dim);
  prefill_item_bf16_with(a, kvh, qb, scratch, [&](int64_t k0, const int* tiles, int nt,
                                                  const PrefillScratch& w) {
    block_products_all(false, a, K, nullptr, k0, tiles, nt, w);
  }, pack_queries, false);
}
