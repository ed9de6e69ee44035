// Window scores on AMX tiles (included by isa_avx512_amx.cpp after amx_util.h), for bf16 pools
// and queries: out[h, j] = sum_i exp(q_i . k_j * scale - lse_i) over the window rows i of head
// h that see slot j, as window_impl.h computes it.
//
// Per 16 slots of a page and 16 window rows: C[16 slots][16 rows] += A[16 key rows][32
// elements] * B[32 elements][16 rows], A straight from the page, B the unscaled bf16 queries in
// pairs (WindowArgs::qpairs, laid out by the binding), so the logits are exact products summed
// in fp32. What is left on the vector units is the exponential, and each head's sum over its
// rows: per slot a vector of 16 rows, summed over the head's row blocks, then 16 slots reduced
// at once (reduce_lanes). Tile registers: 0, 1 logits of two row blocks; 2 key rows; 3, 4
// query pairs (all eight are configured 16 x 64 bytes: window_fused_amx.h keeps key rows in
// 4 .. 7).

static int64_t window_scratch_amx(const WindowArgs& a) {
  const int64_t vector = window_scratch(a), tiles = 16 + 2 * 256 + 16 * a.head_dim / 2 + 16;
  return vector > tiles ? vector : tiles;
}

// Logits of 16 key rows against row blocks rb and rb + 1 (if two) into c[0..256), c[256..512):
// [16 slots][16 rows] fp32 each.
static void window_block_logits(const WindowArgs& a, const uint16_t* K, const uint32_t* qp,
                                int64_t rb, int count, float* c) {
  const int64_t d = a.head_dim, chunks = d / kAmxChunk;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    _tile_loadd(2, K + ch * kAmxChunk, d * sizeof(uint16_t));
    _tile_loadd(3, qp + (rb * chunks + ch) * 256, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (count > 1) {
      _tile_loadd(4, qp + ((rb + 1) * chunks + ch) * 256, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  _tile_stored(0, c, 64);
  if (count > 1) _tile_stored(1, c + 256, 64);
}

// Window scores of one page; tiles configured by the caller, c: two C tiles, stage: [16][d].
static void window_page_amx(const WindowArgs& a, int64_t kvh, int64_t pi, float* c,
                            uint16_t* stage) {
  const int64_t bs = a.block_size, d = a.head_dim, R = a.rows;
  const int64_t s_begin = pi * bs;
  const int64_t s_end = s_begin + bs < a.num_slots ? s_begin + bs : a.num_slots;
  const uint16_t* page = static_cast<const uint16_t*>(a.pool) +
                         a.block_table[pi] * 2 * a.num_kv_heads * bs * d + kvh * bs * d;
  const uint32_t* qp = a.qpairs + kvh * R * d / 2;  // [rows / 16][chunks][16][16]
  const float* lse = a.lse + kvh * R;
  const vf log2e = splat(kLog2e), qscale = splat(a.scale * kLog2e);
  const int64_t blocks_per_head = a.rows_per_head / 16;
  for (int64_t s0 = s_begin; s0 < s_end; s0 += 16) {
    const int64_t ns = s_end - s0 < 16 ? s_end - s0 : 16;
    const uint16_t* K = page + (s0 - s_begin) * d;
    if (s0 - s_begin + 16 > bs) {  // the page ends within these 16 rows: stage, zero the rest
      const int64_t rows = bs - (s0 - s_begin);
      __builtin_memcpy(stage, K, rows * d * sizeof(uint16_t));
      __builtin_memset(stage + rows * d, 0, (16 - rows) * d * sizeof(uint16_t));
      K = stage;
    }
    for (int64_t h = 0; h < a.group; ++h) {
      // Per slot i: the exp terms of this head's rows, 16 rows per lane. All 16 slots are
      // computed (constant trip counts keep the sums in registers); rows past the page's
      // held slots give garbage that is never written out.
      vf sum[16];
      for (int i = 0; i < 16; ++i) sum[i] = splat(0.0f);
      const int64_t rb0 = h * blocks_per_head, rb1 = rb0 + blocks_per_head;
      for (int64_t rb = rb0; rb < rb1; rb += 2) {
        const int count = rb + 1 < rb1 ? 2 : 1;
        window_block_logits(a, K, qp, rb, count, c);
        for (int b = 0; b < count; ++b) {
          const int64_t row = (rb + b) * 16;
          // Row r sees slot s0 + i iff i <= thr[r] - s0.
          const vf lse2 = loadu(lse + row) * log2e, last = loadu(a.thr + row) - splat((float)s0);
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {
            const vf e = vexp2(loadu(c + b * 256 + i * 16) * qscale - lse2);
            sum[i] += splat((float)i) <= last ? e : splat(0.0f);
          }
        }
      }
      const vf total = reduce_lanes(sum);  // lane i: slot s0 + i
      float* out = a.out + (kvh * a.group + h) * a.num_slots + s0;
      for (int64_t i = 0; i < ns; ++i) out[i] = total[i];
    }
  }
}

static void window_pages_or_amx(const WindowArgs& a, int64_t kvh, int64_t page_begin,
                               int64_t page_end, float* scratch) {
  if (a.qpairs == nullptr) {  // fp32 pool or queries: the vector kernel
    window_pages(a, kvh, page_begin, page_end, scratch);
    return;
  }
  float* base = scratch + (16 - (reinterpret_cast<uintptr_t>(scratch) / 4) % 16) % 16;
  float* c = base + 16;  // two C tiles
  configure_full_tiles(reinterpret_cast<TileConfig*>(base));
  for (int64_t pi = page_begin; pi < page_end; ++pi)
    window_page_amx(a, kvh, pi, c, reinterpret_cast<uint16_t*>(c + 2 * 256));
  _tile_release();  // see decode_item_amx
}
