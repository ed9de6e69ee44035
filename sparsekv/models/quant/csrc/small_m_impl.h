// What the AVX-512 bf16- and int8-activation small-M kernels share (quant_bf16_impl.h,
// quant_q8_impl.h, quant_x16_impl.h): the lane sum of a quad's accumulator and the pass
// structure of their GEMMs. Included by their isa_*.cpp inside its namespace, after quant.h,
// immintrin.h (AVX-512 F) and kernel_common_impl.h.

// y[r, i0 .. i0 + nr - 1] <- the four 128-bit lane groups of acc (one weight row each), each
// summed (l0 + l2) + (l1 + l3).
static inline void store_quad(const MatmulArgs& a, int64_t r, int64_t i0, int nr, __m512 acc) {
  __m512 v = _mm512_add_ps(acc, _mm512_shuffle_ps(acc, acc, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  alignas(64) float sums[16];
  _mm512_store_ps(sums, v);
  for (int g = 0; g < nr; ++g) store_y(a, r, i0 + g, sums[4 * g]);
}


// The passes of a small-M GEMM over one tile of weight rows: the rows of x go in passes of up to
// kPassRows, whose fp32 accumulators (one vector per row) persist across chunks of Chunk blocks.
// Per chunk, expand(b0, nb) prepares blocks b0 .. b0 + nb - 1 of the tile, then
// rows.template operator()<R>(r, b0, nb, acc + ...) adds rows r .. r + R - 1 of x times them
// (R = 4, then the 1-3 left over: R independent accumulator chains); store(r, acc) writes row r.
template <int Chunk, typename Expand, typename Rows, typename Store>
static inline void small_m_passes(const MatmulArgs& a, Expand&& expand, Rows&& rows_of,
                                  Store&& store) {
  const int64_t blocks = a.k / kBlock;
  __m512 acc[kPassRows];
  for (int64_t r0 = 0; r0 < a.m; r0 += kPassRows) {
    const int64_t rows = a.m - r0 < kPassRows ? a.m - r0 : kPassRows;
    for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < blocks; b0 += Chunk) {
      const int nb = static_cast<int>(blocks - b0 < Chunk ? blocks - b0 : Chunk);
      expand(b0, nb);
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) rows_of.template operator()<4>(r0 + r, b0, nb, acc + r);
      switch (rows - r) {
        case 3: rows_of.template operator()<3>(r0 + r, b0, nb, acc + r); break;
        case 2: rows_of.template operator()<2>(r0 + r, b0, nb, acc + r); break;
        case 1: rows_of.template operator()<1>(r0 + r, b0, nb, acc + r); break;
        default: break;
      }
    }
    for (int64_t r = 0; r < rows; ++r) store(r0 + r, acc[r]);
  }
}
