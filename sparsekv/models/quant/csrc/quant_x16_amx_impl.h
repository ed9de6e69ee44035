// The x16 int8-activation GEMM on AMX-INT8 tiles (`tdpbsud`: signed x bytes times unsigned
// weight codes, summed in fours into int32), from kAmxMinRows rows of x; fewer keep the
// AVX512-VNNI kernel of quant_x16_impl.h. Included by isa_avx512_amx.cpp after that header, in
// its namespace.
//
// The x16 group-block is already the B operand's pair layout: its code vector t (16 weight rows
// x their codes 4t .. 4t + 3, 64 bytes) is B's row t, so one group-block is a B tile of 8 rows
// (Q8_0 loads it straight from the weight; the 4-bit formats split their nibbles into a 512-byte
// buffer first). The A operand is x's two int8 levels of one block, 32 bytes per row in the
// order of quant_q8_impl.h: row 2j the high codes of x row j, row 2j + 1 its residual codes (x's
// code buffer interleaves them with a row stride of k bytes). One tile product then gives, for up
// to 8 rows of x, both levels' integer dot products with all 16 weight rows:
//   C[2j][i] = sum_e qh_je q_ie,  C[2j + 1][i] = sum_e ql_je q_ie.
// Each block's scales differ per weight row and x row, so C leaves the tile every block, and the
// per-row arithmetic is that of quant_x16_impl.h's x16_block_row on the same integers in the same
// order: the results equal the VNNI kernel's bit for bit.

constexpr int kAmxXRows = 8;  // rows of x per tile product (16 tile rows: two levels each)
// Fewer rows of x keep the VNNI kernel: a block's tile loads, product and store form a latency
// chain that its few rows cannot amortize (SmolLM2's gate + up Q4_1, weights in cache, Emerald
// Rapids: one thread 78 against 61 us at 2 rows, even at 4-5; two threads even at 5 rows, 119
// against 176 us at 16; in the engine, 4-row decode steps gained ~9%).
constexpr int64_t kAmxMinRows = 4;

struct AmxTileConfig {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles, two sets so that two blocks' products overlap: 0 and 3 the weight codes B [8][64
// bytes]; 1 and 4 x's codes A [2 rows][32 bytes]; 2 and 5 the dot products C [2 rows][16
// int32]. `rows`: rows of x per product (1-8).
static inline void configure_x16_tiles(int rows) {
  AmxTileConfig cfg;
  __builtin_memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int set = 0; set < 2; ++set) {
    const int t = 3 * set;
    cfg.rows[t] = 8;
    cfg.colsb[t] = 64;
    cfg.rows[t + 1] = cfg.rows[t + 2] = static_cast<uint8_t>(2 * rows);
    cfg.colsb[t + 1] = kBlock;
    cfg.colsb[t + 2] = 64;
  }
  _tile_loadconfig(&cfg);
}

// GCC's tile intrinsics take the register number as a literal (they paste it into the
// instruction), so the two sets are spelled out here.
template <int Set>
static inline void load_codes_tile(const void* codes) {
  if constexpr (Set == 0) {
    _tile_loadd(0, codes, 64);
  } else {
    _tile_loadd(3, codes, 64);
  }
}

// C = A B of one product of set Set, A loaded from `x` (row stride `stride` bytes) and C stored
// at `dots` (row stride 64 bytes).
template <int Set>
static inline void tile_product(const int8_t* x, int64_t stride, int32_t* dots) {
  if constexpr (Set == 0) {
    _tile_loadd(1, x, stride);
    _tile_zero(2);
    _tile_dpbsud(2, 1, 0);
    _tile_stored(2, dots, 64);
  } else {
    _tile_loadd(4, x, stride);
    _tile_zero(5);
    _tile_dpbsud(5, 4, 3);
    _tile_stored(5, dots, 64);
  }
}

constexpr int kAmxChunkBlocks = 8;  // group-blocks whose codes are laid out at a time (4 KiB)

// GCC does not model tile loads and stores as memory accesses: without a compiler barrier it
// may sink vector stores a tile load reads, or hoist vector loads of what a tile store writes.
static inline void memory_barrier() { asm volatile("" ::: "memory"); }

// Pointers to the B operand of group-blocks gb, gb + gb_bytes, ... (nb of them): Q8_0's codes
// in place; the 4-bit formats' nibbles split into `split` [nb][512]. A whole chunk is split
// before any of its tiles load: split and loaded block by block, the loads waited on the
// stores (~35% slower at 2 rows). Prefetches the weight stream ahead, up to `limit`.
template <int F>
static inline void x16_codes_for_tiles(const uint8_t* gb, int64_t gb_bytes, int nb,
                                       const uint8_t* limit, uint8_t (*split)[512],
                                       const uint8_t** codes) {
  for (int j = 0; j < nb; ++j) {
    prefetch_weights_ahead(gb + j * gb_bytes, gb_bytes, limit);
    const uint8_t* c = gb + j * gb_bytes + x16_header_bytes<F>();
    if constexpr (F == kQ8_0) {
      codes[j] = c;
    } else {
      __m512i v[8];  // the code vectors in B's row order (quant_x16_impl.h)
      x16_codes<F>(gb + j * gb_bytes, v);
      for (int t = 0; t < 8; ++t) _mm512_store_si512(split[j] + 64 * t, v[t]);
      codes[j] = split[j];
    }
  }
  memory_barrier();
}

// The products of block b's codes (set Set's B tile, loaded) with x rows p0 .. p0 + rows - 1,
// `tile_rows` at a time: x row p0 + r's high-level dots land at dots + 32 * r, its residual's
// 16 further.
template <int Set>
static inline void x16_tile_products(const MatmulArgs& a, int64_t p0, int64_t rows,
                                     int tile_rows, int64_t b, int32_t* dots) {
  for (int64_t r = 0; r < rows; r += tile_rows)
    tile_product<Set>(a.x_q8 + 2 * (p0 + r) * a.k + b * kBlock, a.k, dots + 32 * r);
  memory_barrier();
}

// acc[j] += x row r0 + j times the group-block (j < n), from the tile product's C (stored at
// `dots`, [2 * kAmxXRows][16] int32) and the block's d and Q4_1's m, scaled as x16_block_row
// does (x16_scale_dots).
template <int F>
static inline void x16_amx_block_rows(const MatmulArgs& a, const int32_t* dots, __m512 d,
                                      __m512 m, int64_t r0, int n, int64_t b, __m512* acc) {
  const int64_t blocks = a.k / kBlock;
  for (int j = 0; j < n; ++j) {
    const int64_t at = (r0 + j) * blocks + b;
    __m512i low = _mm512_load_si512(dots + 32 * j + 16);
    if constexpr (zero_point<F>() != 0)
      low = _mm512_add_epi32(low, _mm512_set1_epi32(-zero_point<F>() * a.x_q8_sums[at]));
    acc[j] = x16_scale_dots<F>(a, _mm512_load_si512(dots + 32 * j), low, d, m, at, acc[j]);
  }
}

// acc[0 .. rows - 1] += x rows p0 .. of the pass times group-block b, from its products.
template <int F>
static inline void x16_amx_block(const MatmulArgs& a, const uint8_t* gb, const int32_t* dots,
                                 int64_t p0, int64_t rows, int tile_rows, int64_t b,
                                 __m512* acc) {
  __m512 d, m;
  x16_scales<F>(gb, d, m);
  for (int64_t r = 0; r < rows; r += tile_rows) {
    const int n = rows - r < tile_rows ? static_cast<int>(rows - r) : tile_rows;
    x16_amx_block_rows<F>(a, dots + 32 * r, d, m, p0 + r, n, b, acc + r);
  }
}

// Weight rows [begin, end) (multiples of 16) times every row of x, two blocks at a time on the
// two tile sets. x's code buffer must hold whole products: rows up to the next multiple of
// min(m, 8), the extra ones zero (the binding's run_q8 pads to 8).
template <int F>
static void gemm_x16_amx_rows(const MatmulArgs& a, int64_t begin, int64_t end) {
  const int64_t blocks = a.k / kBlock;
  const int64_t gb_bytes = x16_group_block_bytes<F>();
  const int tile_rows = a.m < kAmxXRows ? static_cast<int>(a.m) : kAmxXRows;
  configure_x16_tiles(tile_rows);
  alignas(64) uint8_t split[kAmxChunkBlocks][512];
  alignas(64) int32_t dots[2][2 * kPassRows * 16];  // per block: [2 * rows][16]
  const uint8_t* codes[kAmxChunkBlocks];
  __m512 acc[kPassRows];
  const uint8_t* limit = a.w + end / 16 * blocks * gb_bytes;
  for (int64_t i0 = begin; i0 < end; i0 += 16) {
    const uint8_t* group = a.w + i0 / 16 * blocks * gb_bytes;
    for (int64_t p0 = 0; p0 < a.m; p0 += kPassRows) {
      const int64_t rows = a.m - p0 < kPassRows ? a.m - p0 : kPassRows;
      for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t b0 = 0; b0 < blocks; b0 += kAmxChunkBlocks) {
        const int nb = static_cast<int>(blocks - b0 < kAmxChunkBlocks ? blocks - b0
                                                                      : kAmxChunkBlocks);
        const uint8_t* gb = group + b0 * gb_bytes;
        x16_codes_for_tiles<F>(gb, gb_bytes, nb, limit, split, codes);
        for (int j = 0; j < nb; j += 2) {  // two blocks, one per tile set (one at an odd end)
          const bool pair = j + 1 < nb;
          load_codes_tile<0>(codes[j]);
          if (pair) load_codes_tile<1>(codes[j + 1]);
          x16_tile_products<0>(a, p0, rows, tile_rows, b0 + j, dots[0]);
          if (pair) x16_tile_products<1>(a, p0, rows, tile_rows, b0 + j + 1, dots[1]);
          x16_amx_block<F>(a, gb + j * gb_bytes, dots[0], p0, rows, tile_rows, b0 + j, acc);
          if (pair)
            x16_amx_block<F>(a, gb + (j + 1) * gb_bytes, dots[1], p0, rows, tile_rows,
                             b0 + j + 1, acc);
        }
      }
      for (int64_t r = 0; r < rows; ++r) store_group(a, p0 + r, i0, acc[r]);
    }
  }
  _tile_release();
}

// The x16 GEMM of this variant: AMX tiles from kAmxMinRows rows of x, the VNNI kernel below.
static void gemm_x16_amx(const MatmulArgs& a, int64_t begin, int64_t end) {
  if (a.m < kAmxMinRows) return gemm_x16(a, begin, end);
  switch (a.format) {
    case kQ4_0X16: return gemm_x16_amx_rows<kQ4_0>(a, begin, end);
    case kQ4_1X16: return gemm_x16_amx_rows<kQ4_1>(a, begin, end);
    default: return gemm_x16_amx_rows<kQ8_0>(a, begin, end);
  }
}
