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

#include "window_fused_passes.h"

static int64_t window_fused_scratch_amx(const WindowFusedArgs& a) {
  return 32 + a.rows * a.head_dim / 2 + a.num_blocks * 16 * a.rows + 8 * a.head_dim +
         4 * a.rows + 64;
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
  configure_full_tiles(reinterpret_cast<TileConfig*>(base));
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
