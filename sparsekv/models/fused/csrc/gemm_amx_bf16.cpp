// bf16 linear layer for a few rows of activations (decode at batch 2-32) with AMX tiles:
// y [m, n] = x [m, k] W [n, k]^T, fp32 accumulation, one rounding to bf16 at the end.
//
// Why AMX and this orientation: at these row counts the layer is bound by reading W once, and
// oneDNN's per-call setup and blocking cost ~2x that. The tiles compute C^T = W x^T, so the
// A operand (16 rows of W x 32 k) is loaded straight from the plain row-major weight (no packed
// copy; the tied lm_head reads the embedding table itself), and only x, which is small, is
// rearranged per call into the VNNI pair layout the B operand needs. Each weight tile is loaded
// once per 16 rows of x, so for m <= 16 W is read exactly once. C [16 n][16 m] is transposed in
// registers before the bf16 rounding and the store into y's rows.
//
// Plain-C++ interface (fused.h): no torch or standard headers under this target pragma.
#include <stdint.h>

#include "fused.h"

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,amx-tile,amx-bf16")
#include <immintrin.h>

namespace sparsekv_fused {
namespace {

constexpr int kTile = 16;  // rows of every tile; also n rows of W and m rows of x per tile
constexpr int kChunk = 32;  // bf16 elements of k per tile row (64 bytes)
constexpr int kGroup = 4;  // W tiles sharing one x tile per k chunk (64 output features)

// Tile register use (all 16 rows x 64 bytes): 0-3 accumulators C, 4 the x tile B, 5 and 6
// alternate as W tiles A so one can load while the other multiplies; 7 a second x tile B
// (group_pair: 32 rows of x).
struct alignas(64) TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles() {
  TileConfig cfg = {};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTile;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// In-register transpose of a 16 x 16 block of 32-bit elements (r[i] = row i on entry, column i
// on return): interleave 32-bit, then 64-bit elements within 128-bit lanes, then the lanes.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  __m512 s[16];  // s[4j + c], lane L: column 4L + c of rows 4j..4j+3
  for (int j = 0; j < 16; j += 4) {
    const __m512d a = _mm512_castps_pd(t[j]), b = _mm512_castps_pd(t[j + 2]);
    const __m512d c = _mm512_castps_pd(t[j + 1]), d = _mm512_castps_pd(t[j + 3]);
    s[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    s[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    s[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    s[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v = _mm512_shuffle_f32x4(s[c], s[4 + c], 0x88);
    const __m512 w = _mm512_shuffle_f32x4(s[c], s[4 + c], 0xdd);
    const __m512 v2 = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0x88);
    const __m512 w2 = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0xdd);
    r[c] = _mm512_shuffle_f32x4(v, v2, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(v, v2, 0xdd);
    r[4 + c] = _mm512_shuffle_f32x4(w, w2, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(w, w2, 0xdd);
  }
}

// fp32 -> bf16 bit patterns, round to nearest even as torch does (NaN -> 0x7fc0). Not
// vcvtneps2bf16: it flushes subnormals to zero.
inline __m256i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// GCC does not model tile loads and stores as memory accesses: without a compiler barrier it
// may drop or sink vector stores a tile load reads (seen: the last row of a padded buffer
// missing), or hoist vector loads of what a tile store writes.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

inline __mmask32 mask32(int64_t count) {
  return count >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << count) - 1);
}
inline __mmask16 mask16(int64_t count) {
  return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
}

// Copies rows [n0, n0 + rows) x k [k0, k0 + count) of W into a zero-padded 16 x 32 tile image
// (the last partial k chunk, or the rows past the end of W).
void pad_w_tile(const SmallGemmArgs& a, int64_t n0, int64_t rows, int64_t k0, uint16_t* buf) {
  const __mmask32 mask = mask32(a.k - k0);
  for (int r = 0; r < kTile; ++r) {
    __m512i v = _mm512_setzero_si512();
    if (r < rows) v = _mm512_maskz_loadu_epi16(mask, a.w + (n0 + r) * a.k + k0);
    _mm512_store_si512(buf + r * kChunk, v);
  }
  memory_barrier();
}

// C tiles 0..3 += W rows [n0, n0 + 64) x^T over every k chunk of the x block `xb`. Full rows
// only; the k tail goes through a padded tile image.
void group_full(const SmallGemmArgs& a, int64_t n0, const uint16_t* xb) {
  const int64_t full = a.k / kChunk, stride = a.k * 2;
  const uint16_t* w = a.w + n0 * a.k;
  const int64_t rows16 = kTile * a.k;
  for (int64_t c = 0; c < full; ++c) {
    const int64_t k0 = c * kChunk;
    _tile_loadd(4, xb + c * kTile * kChunk, 64);
    _tile_loadd(5, w + k0, stride);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(6, w + rows16 + k0, stride);
    _tile_dpbf16ps(1, 6, 4);
    _tile_loadd(5, w + 2 * rows16 + k0, stride);
    _tile_dpbf16ps(2, 5, 4);
    _tile_loadd(6, w + 3 * rows16 + k0, stride);
    _tile_dpbf16ps(3, 6, 4);
  }
  if (full * kChunk < a.k) {
    alignas(64) uint16_t buf[kGroup][kTile * kChunk];
    for (int g = 0; g < kGroup; ++g) pad_w_tile(a, n0 + g * kTile, kTile, full * kChunk, buf[g]);
    _tile_loadd(4, xb + full * kTile * kChunk, 64);
    _tile_loadd(5, buf[0], 64);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(6, buf[1], 64);
    _tile_dpbf16ps(1, 6, 4);
    _tile_loadd(5, buf[2], 64);
    _tile_dpbf16ps(2, 5, 4);
    _tile_loadd(6, buf[3], 64);
    _tile_dpbf16ps(3, 6, 4);
  }
}

// C tiles 0, 1 (x rows of xb0) and 2, 3 (x rows of xb1) += W rows [n0, n0 + 16) and
// [n0 + 16, n0 + 32) x^T: 32 rows of x per weight tile load (each W tile would otherwise be
// read twice, the second time from L2, which costs as much as the first).
void group_pair(const SmallGemmArgs& a, int64_t n0, const uint16_t* xb0, const uint16_t* xb1) {
  const int64_t full = a.k / kChunk, stride = a.k * 2;
  const uint16_t* w = a.w + n0 * a.k;
  const int64_t rows16 = kTile * a.k, tile = kTile * kChunk;
  for (int64_t c = 0; c < full; ++c) {
    const int64_t k0 = c * kChunk;
    _tile_loadd(4, xb0 + c * tile, 64);
    _tile_loadd(7, xb1 + c * tile, 64);
    _tile_loadd(5, w + k0, stride);
    _tile_loadd(6, w + rows16 + k0, stride);
    _tile_dpbf16ps(0, 5, 4);
    _tile_dpbf16ps(1, 6, 4);
    _tile_dpbf16ps(2, 5, 7);
    _tile_dpbf16ps(3, 6, 7);
  }
  if (full * kChunk < a.k) {
    alignas(64) uint16_t buf[2][kTile * kChunk];
    pad_w_tile(a, n0, kTile, full * kChunk, buf[0]);
    pad_w_tile(a, n0 + kTile, kTile, full * kChunk, buf[1]);
    _tile_loadd(4, xb0 + full * tile, 64);
    _tile_loadd(7, xb1 + full * tile, 64);
    _tile_loadd(5, buf[0], 64);
    _tile_loadd(6, buf[1], 64);
    _tile_dpbf16ps(0, 5, 4);
    _tile_dpbf16ps(1, 6, 4);
    _tile_dpbf16ps(2, 5, 7);
    _tile_dpbf16ps(3, 6, 7);
  }
}

// C tile 0 += W rows [n0, n0 + rows) x^T, rows <= 16 (a group's remainder; missing rows are
// zero).
void block_single(const SmallGemmArgs& a, int64_t n0, int64_t rows, const uint16_t* xb) {
  const int64_t chunks = (a.k + kChunk - 1) / kChunk;
  alignas(64) uint16_t buf[kTile * kChunk];
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = c * kChunk;
    _tile_loadd(4, xb + c * kTile * kChunk, 64);
    if (rows == kTile && k0 + kChunk <= a.k) {
      _tile_loadd(5, a.w + n0 * a.k + k0, a.k * 2);
    } else {
      pad_w_tile(a, n0, rows, k0, buf);
      _tile_loadd(5, buf, 64);
    }
    _tile_dpbf16ps(0, 5, 4);
  }
}

// y[m0 + i, n0 + j] = bf16(c[j][i]) for i < m_rows, j < n_rows: c is one stored C tile
// [16 n][16 m].
void store_tile(const SmallGemmArgs& a, const float* c, int64_t n0, int64_t n_rows, int64_t m0,
                int64_t m_rows) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c + i * 16);
  transpose16(r);
  const __mmask16 mask = mask16(n_rows);
  for (int64_t i = 0; i < m_rows; ++i)
    _mm256_mask_storeu_epi16(a.y + (m0 + i) * a.y_stride + n0, mask, round_bf16(r[i]));
}

void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

void store_accumulators(float (*c)[kTile * kTile]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  memory_barrier();
}

int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Output features [n0, n0 + 64) (fewer at the end of W) for every row of x: 32 rows of x at a
// time through group_pair, 16 through group_full, and a partial group tile by tile.
void run_group(const SmallGemmArgs& a, int64_t n0) {
  const int64_t rows = min64(a.n - n0, kGroup * kTile);
  const int64_t x_tile_step = (a.k + kChunk - 1) / kChunk * kTile * kChunk;
  alignas(64) float c[kGroup][kTile * kTile];
  for (int64_t m0 = 0; m0 < a.m;) {
    const uint16_t* xb = a.xv + (m0 / kTile) * x_tile_step;
    const int64_t m_rows = min64(a.m - m0, kTile);
    if (rows == kGroup * kTile && a.m - m0 > kTile) {
      const int64_t m_rows2 = min64(a.m - m0 - kTile, kTile);
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t nh = n0 + half * 2 * kTile;
        zero_accumulators();
        group_pair(a, nh, xb, xb + x_tile_step);
        store_accumulators(c);
        store_tile(a, c[0], nh, kTile, m0, m_rows);
        store_tile(a, c[1], nh + kTile, kTile, m0, m_rows);
        store_tile(a, c[2], nh, kTile, m0 + kTile, m_rows2);
        store_tile(a, c[3], nh + kTile, kTile, m0 + kTile, m_rows2);
      }
      m0 += 2 * kTile;
      continue;
    }
    if (rows == kGroup * kTile) {
      zero_accumulators();
      group_full(a, n0, xb);
      store_accumulators(c);
      for (int g = 0; g < kGroup; ++g) store_tile(a, c[g], n0 + g * kTile, kTile, m0, m_rows);
    } else {
      for (int64_t b = 0; b < rows; b += kTile) {
        const int64_t block_rows = min64(rows - b, kTile);
        _tile_zero(0);
        block_single(a, n0 + b, block_rows, xb);
        _tile_stored(0, c[0], 64);
        memory_barrier();
        store_tile(a, c[0], n0 + b, block_rows, m0, m_rows);
      }
    }
    m0 += kTile;
  }
}

}  // namespace

// x [m, k] (row stride x_stride) -> the B tiles of gemm_bf16_amx: [m / 16][k / 32][16][16][2]
// (both rounded up, zero-padded): element [mb][c][r][j][e] = x[16 mb + j][32 c + 2 r + e].
void pack_x_vnni(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, uint16_t* xv) {
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  for (int64_t m0 = 0; m0 < m; m0 += kTile) {
    for (int64_t c = 0; c < chunks; ++c) {
      const __mmask32 mask = mask32(k - c * kChunk);
      __m512 r[16];
      for (int64_t j = 0; j < kTile; ++j)
        r[j] = m0 + j < m ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(
                                mask, x + (m0 + j) * x_stride + c * kChunk))
                          : _mm512_setzero_ps();
      transpose16(r);  // r[i]: the pair (2i, 2i + 1) of every row
      uint16_t* out = xv + ((m0 / kTile) * chunks + c) * kTile * kChunk;
      for (int i = 0; i < kTile; ++i)
        _mm512_storeu_ps(reinterpret_cast<float*>(out + i * kChunk), r[i]);
    }
  }
  memory_barrier();
}

// Output-feature groups [begin, end) of 64 (the last may be partial).
void gemm_bf16_amx(const SmallGemmArgs& args, int64_t begin, int64_t end) {
  configure_tiles();
  for (int64_t g = begin; g < end; ++g) run_group(args, g * kGroup * kTile);
  _tile_release();  // smaller state for the context switches of this thread
}

const bool kGemmAmxCompiled = true;
}  // namespace sparsekv_fused
#else
namespace sparsekv_fused {
void pack_x_vnni(const uint16_t*, int64_t, int64_t, int64_t, uint16_t*) {}
void gemm_bf16_amx(const SmallGemmArgs&, int64_t, int64_t) {}
const bool kGemmAmxCompiled = false;
}  // namespace sparsekv_fused
#endif
