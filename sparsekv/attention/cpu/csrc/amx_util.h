// AMX helpers (included by isa_avx512_amx.cpp after kernel_impl.h): tile configuration,
// tile-column transposition and the line prefetcher of the AMX decode path.

constexpr int kAmxMaxHeads = 16;  // query heads per pass (tile rows / columns)
constexpr int kAmxChunk = 32;     // bf16 elements per tile row (64 bytes)

#include "amx_tile_config.h"

// Decode tile registers: 0, 1 logits [16 slots][g] fp32 (two row groups); 2, 3 key rows
// [16][32] or value pairs [16][16][2] bf16; 4 query pairs [16][g][2] bf16; 5, 6 output
// columns [g][16] fp32 (two column blocks); 7 probabilities [g][32 slots] bf16.
static void configure_decode_tiles(TileConfig* cfg, int g) {
  const int rows[8] = {16, 16, 16, 16, 16, g, g, g};
  const int colsb[8] = {4 * g, 4 * g, 64, 64, 4 * g, 64, 64, 64};
  __builtin_memset(cfg, 0, sizeof(*cfg));
  cfg->palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg->rows[t] = (uint8_t)rows[t];
    cfg->colsb[t] = (uint16_t)colsb[t];
  }
  _tile_loadconfig(cfg);
}

// Column h of a dense [16][g] fp32 tile (lane i = c[i * g + h]), g <= 16, by two-source
// permutes over 32-float windows; c must have 32 readable floats past 16 * g.
static inline __m512 tile_column(const float* c, int g, int h) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i idx =
      _mm512_add_epi32(_mm512_mullo_epi32(iota, _mm512_set1_epi32(g)), _mm512_set1_epi32(h));
  __m512 col = _mm512_setzero_ps();
  for (int base = 0; base < 16 * g; base += 32) {
    const __mmask16 in = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(base)) &
                         _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(base + 32));
    const __m512 window = _mm512_permutex2var_ps(
        _mm512_loadu_ps(c + base), _mm512_sub_epi32(idx, _mm512_set1_epi32(base)),
        _mm512_loadu_ps(c + base + 16));
    col = _mm512_mask_mov_ps(col, in, window);
  }
  return col;
}

// Prefetching of the AMX decode path. Block tables are random, so the hardware cannot guess
// the next page; and this VM's memory latency (~250 ns) with ~16 line fill buffers per core
// caps software prefetching alone at a few GB/s per core, while a burst of a tile's 128
// prefetches stalls the core until buffers free up. Hence two measures (one thread over a
// 737 MB pool, group 3, head_dim 64: 33 -> 23 ns per slot):
// - two tiles ahead, touch the first line of every key and value run, so the L2 streamer
//   fetches the rest of each run on its own, beyond the fill-buffer limit (`touch_runs`);
// - one tile ahead, prefetch every line, a few at a time between the steps of the current
//   tile (`LinePrefetcher`), the remainder when the next tile starts.
constexpr int kPrefetchLinesPerStep = 4;

struct LinePrefetcher {  // the lines of one tile's key runs, then its value runs
  const char* run[2 * kMaxTilePages];
  int64_t bytes[2 * kMaxTilePages];
  int num_runs = 0, r = 0;
  int64_t offset = 0;

  template <typename T>
  void start(const PageSpan<T>* spans, int n, int64_t kv_stride, int64_t d) {
    num_runs = r = 0;
    offset = 0;
    for (int kv = 0; kv < 2; ++kv)
      for (int k = 0; k < n; ++k) {
        run[num_runs] = reinterpret_cast<const char*>(spans[k].k + kv * kv_stride + spans[k].j0 * d);
        bytes[num_runs++] = spans[k].n * d * (int64_t)sizeof(T);
      }
  }
  void step(int64_t lines = kPrefetchLinesPerStep) {
    if (lines == kPrefetchLinesPerStep && r < num_runs && bytes[r] - offset >= 64 * lines) {
      for (int i = 0; i < kPrefetchLinesPerStep; ++i) __builtin_prefetch(run[r] + offset + 64 * i, 0, 3);
      offset += 64 * kPrefetchLinesPerStep;
      if (offset >= bytes[r]) {
        ++r;
        offset = 0;
      }
      return;
    }
    for (; lines > 0 && r < num_runs; --lines) {
      __builtin_prefetch(run[r] + offset, 0, 3);
      offset += 64;
      if (offset >= bytes[r]) {
        ++r;
        offset = 0;
      }
    }
  }
  void finish() { step(INT64_MAX); }
};
