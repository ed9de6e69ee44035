// Causal prefill (flash) attention on AMX tiles, bf16 in, fp32 accumulation (included by
// isa_avx512_amx.cpp after amx_util.h; interface in prefill.h). The scratch layout, query
// packing, softmax and output write it shares with the AVX512-BF16 kernel are in
// prefill_softmax.h.
//
// Why: PyTorch's CPU flash kernel spends about twice the FLOP bound of a 4k-token prompt
// (GQA heads expanded with repeat_interleave, the softmax on generic vector code), and a
// chunk of a chunked prefill (fewer queries than keys) has no causal fast path at all.
//
// One work item is a block of query rows of every query head of one KV head (the GQA group
// folded into the columns), so each K and V tile is loaded once for the group. Everything is
// computed transposed, keys along rows and queries along columns, as in decode_amx.h:
//   S^T[16 keys][16 queries] += K[16 keys][32 elements] * Qpairs[16 element pairs][16 queries]
// with the query tile packed once per item, and
//   O^T[16 dims][16 queries] += V^T[16 dims][32 keys] * Ppairs[16 key pairs][16 queries]
// with K and V^T cut into contiguous tiles once per call by the binding (prefill.h). A query's
// softmax then runs down a column: the running max, the sum and the rescaling of O^T are
// lane-wise vector operations on 16 queries at once, with no horizontal reduction anywhere.
// Probabilities are rounded to bf16 for the PV product; the denominator sums them unrounded
// in fp32 (as decode_amx.h does). Every buffer is laid out in whole tiles, so that each tile
// load or store moves 1 KiB of contiguous memory.
//
// Causality: key blocks entirely above a column tile's diagonal are skipped, and only the
// blocks that cross it are masked. A sliding window (Gemma 3's local layers: row i sees keys
// (i - window, i]) skips the blocks entirely below a tile's window as well, and masks the
// blocks that cross its lower edge, so a local layer costs O(n x window), not O(n^2).
// Logits are in base 2 (log2(e) folded into the scale).
//
// Cost (SmolLM2-135M layer, 2000 tokens, one thread, ~5.5 ms): about 2/3 tile work, where the
// tile loads and stores between the products cost as much as the products (loading the O^T
// accumulators before the value product is the dearest part), 1/3 the softmax (one pass over
// the logits, ~5 cycles per vector of 16 probabilities: see block_softmax's lazy max).
// Measured and rejected: interleaving the two in a software pipeline (twice; the second time
// with one column tile per AMX step, issued before and halfway through each tile's softmax:
// the lost pairing of the column tiles cost more than the overlap gained, 5.4 -> 6.0 ms; the
// AMX side alone is ~2x its TMUL bound, latency-bound by tile stores and reloads), prefetching
// the next block's keys and values into L1 (slower: they evict the scratch), key blocks of 32
// or 128 and query blocks of 32 (slower: more per-block overhead, or a working set past L1).
//
// Tile registers: 0-3 accumulators (two key or dim tiles x two column tiles), 4, 5 key or
// value tiles, 6, 7 query or probability pairs. All tiles are 16 rows x 64 bytes.

#include "prefill_softmax.h"

static int64_t prefill_scratch_amx(const PrefillArgs& a) {
  return prefill_layout(a, nullptr, nullptr) + 16;  // + 16: room to align the base
}

// Raw logits of key block [k0, k0 + kPKeys) for the listed column tiles into w.s: two key
// tiles by two column tiles at a time (each key and query tile loaded serves two products,
// four independent accumulators), a lone last column tile with two key tiles.
static void block_logits(const PrefillArgs& a, const uint16_t* K, int64_t k0, const int* tiles,
                         int nt, const PrefillScratch& w) {
  const int64_t chunks = a.head_dim / kAmxChunk;
  for (int i = 0; i < nt; i += 2) {
    const bool two = i + 1 < nt;
    const int t0 = tiles[i], t1 = two ? tiles[i + 1] : t0;
    const uint32_t* qp0 = w.qpairs + t0 * chunks * 256;
    const uint32_t* qp1 = w.qpairs + t1 * chunks * 256;
    for (int64_t kt = 0; kt < kPKeys; kt += 32) {
      const uint16_t* rows = K + (k0 + kt) / 16 * chunks * 512;  // two key tiles
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(4, rows + c * 512, 64);
        _tile_loadd(6, qp0 + c * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, rows + (chunks + c) * 512, 64);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, qp1 + c * 256, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* s0 = w.s + (t0 * kPKeys + kt) * 16;
      float* s1 = w.s + (t1 * kPKeys + kt) * 16;
      _tile_stored(0, s0, 64);
      _tile_stored(1, s0 + 256, 64);
      if (two) {
        _tile_stored(2, s1, 64);
        _tile_stored(3, s1 + 256, 64);
      }
    }
  }
}

// O^T[:, tile t] += V^T[:, block] * P[block, tile t] for the listed column tiles, two column
// tiles by two tiles of 16 output dims at a time: each value and probability tile loaded
// serves two products, and the four accumulators are independent (measured 18 -> 12 ns per
// product against one column tile by four dim tiles, whose reloads wait on the products).
static void block_values(const PrefillArgs& a, const uint16_t* Vt, int64_t k0, const int* tiles,
                         int nt, const PrefillScratch& w) {
  const int64_t d = a.head_dim;
  for (int i = 0; i < nt; i += 2) {
    const bool two = i + 1 < nt;
    const int t0 = tiles[i], t1 = two ? tiles[i + 1] : t0;
    const uint32_t* p0 = w.p + t0 * (kPKeys / 32) * 256;
    const uint32_t* p1 = w.p + t1 * (kPKeys / 32) * 256;
    for (int64_t e0 = 0; e0 < d; e0 += 32) {
      float* o0 = w.o + (t0 * d + e0) * 16;
      float* o1 = w.o + (t1 * d + e0) * 16;
      _tile_loadd(0, o0, 64);
      _tile_loadd(1, o0 + 256, 64);
      if (two) {
        _tile_loadd(2, o1, 64);
        _tile_loadd(3, o1 + 256, 64);
      }
      for (int64_t ks = 0; ks < kPKeys / 32; ++ks) {
        const uint16_t* v = Vt + ((k0 / 32 + ks) * d + e0) * 32;  // [dims][32 keys] tiles
        _tile_loadd(4, v, 64);
        _tile_loadd(6, p0 + ks * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, v + 512, 64);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, p1 + ks * 256, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, o0, 64);
      _tile_stored(1, o0 + 256, 64);
      if (two) {
        _tile_stored(2, o1, 64);
        _tile_stored(3, o1 + 256, 64);
      }
    }
  }
}

static void prefill_item_amx(const PrefillArgs& a, int64_t kvh, int64_t qb, float* scratch) {
  PrefillScratch w;
  prefill_layout(a, scratch + (16 - (reinterpret_cast<uintptr_t>(scratch) / 4) % 16) % 16, &w);
  const int64_t cols = prefill_columns(a), ntiles = cols / 16, d = a.head_dim;
  const int64_t q0 = qb * a.query_block;
  const int64_t rows = a.nq - q0 < a.query_block ? a.nq - q0 : a.query_block;
  pack_queries(a, kvh, q0, w);
  for (int64_t c = 0; c < cols; ++c) {
    w.m[c] = kNoMax;
    w.l[c] = 0.0f;
  }
  __builtin_memset(w.o, 0, d * cols * sizeof(float));
  const uint16_t* K = a.key + kvh * a.nkp * d;
  const uint16_t* Vt = a.value_t + kvh * a.nkp * d;
  const float scale2 = a.scale * kLog2e;
  const int64_t last_key = a.nk - a.nq + q0 + rows - 1;
  const int32_t reach = window_reach(a);
  // The first block any column sees: below it, every key is past every window.
  const int64_t first_key = a.nk - a.nq + q0 - reach;
  const int64_t first_block = first_key > 0 ? first_key / kPKeys * kPKeys : 0;
  configure_full_tiles(w.cfg);
  for (int64_t k0 = first_block; k0 <= last_key; k0 += kPKeys) {
    // Column tiles that see some key of the block, and whether the block crosses their
    // diagonal or window edge (thresholds rise along a tile, padding rows last).
    int tiles[kPMaxTiles];
    bool masked[kPMaxTiles];
    int nt = 0;
    for (int t = 0; t < ntiles; ++t) {
      const int64_t low = w.thr[t * 16], high = w.thr[t * 16 + 15];
      if (k0 > high || k0 + kPKeys - 1 < low - reach) continue;
      masked[nt] = k0 + kPKeys - 1 > low || k0 < high - reach;
      tiles[nt++] = t;
    }
    block_logits(a, K, k0, tiles, nt, w);
    for (int i = 0; i < nt; ++i)
      rescale_output(masked[i] ? block_softmax<true>(k0, tiles[i], scale2, reach, w)
                               : block_softmax<false>(k0, tiles[i], scale2, reach, w),
                     tiles[i], d, w);
    block_values(a, Vt, k0, tiles, nt, w);
  }
  _tile_release();  // see decode_item_amx
  write_rows(a, kvh, q0, rows, cols, w);
}
