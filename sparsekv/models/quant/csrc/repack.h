// Conversions between Q4_0 / Q4_1 / Q8_0 rows and their x16 group layouts (quant.h), in plain
// C++ for the binding (any CPU): the load-time repack and the dequantization of x16 weights
// (the prefill path's dense tiles).
#pragma once

#include <stdint.h>

#include "quant.h"

namespace sparsekv_quant {

struct X16Layout {
  int source;        // kQ4_0, kQ4_1 or kQ8_0
  int block_bytes;   // bytes of a source block of 32
  int codes_at;      // offset of a source block's codes
  int header_bytes;  // of a group-block: 16 d (+ 16 m)
  int code_vectors;  // 64-byte code vectors of a group-block
  int group_block_bytes() const { return header_bytes + 64 * code_vectors; }
};

// The x16 layout of `format` (an x16 code or its source code); source -1 for other formats.
inline X16Layout x16_layout(int format) {
  switch (format) {
    case kQ4_0:
    case kQ4_0X16: return {kQ4_0, 18, 2, 32, 4};
    case kQ4_1:
    case kQ4_1X16: return {kQ4_1, 20, 4, 64, 4};
    case kQ8_0:
    case kQ8_0X16: return {kQ8_0, 34, 2, 32, 8};
    default: return {-1, 0, 0, 0, 0};
  }
}

// Source rows [16 g0, 16 g1) of w (row_bytes each, k inputs) into groups [g0, g1) of out.
inline void repack_x16(const uint8_t* w, int64_t row_bytes, int format, int64_t k, uint8_t* out,
                       int64_t g0, int64_t g1) {
  const X16Layout l = x16_layout(format);
  const int64_t blocks = k / kBlock, gbb = l.group_block_bytes();
  const uint8_t flip = l.source == kQ8_0 ? 0x80 : 0x00;  // int8 codes -> unsigned q + 128
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* gb = out + (g * blocks + b) * gbb;
      for (int i = 0; i < 16; ++i) {
        const uint8_t* src = w + (16 * g + i) * row_bytes + b * l.block_bytes;
        gb[2 * i] = src[0];
        gb[2 * i + 1] = src[1];
        if (l.source == kQ4_1) {
          gb[32 + 2 * i] = src[2];
          gb[32 + 2 * i + 1] = src[3];
        }
        for (int t = 0; t < l.code_vectors; ++t)
          for (int j = 0; j < 4; ++j)
            gb[l.header_bytes + 64 * t + 4 * i + j] = src[l.codes_at + 4 * t + j] ^ flip;
      }
    }
  }
}

// Groups [g0, g1) of an x16 weight back to source rows (the inverse of repack_x16).
inline void unpack_x16(const uint8_t* packed, int format, int64_t k, uint8_t* rows,
                       int64_t row_bytes, int64_t g0, int64_t g1) {
  const X16Layout l = x16_layout(format);
  const int64_t blocks = k / kBlock, gbb = l.group_block_bytes();
  const uint8_t flip = l.source == kQ8_0 ? 0x80 : 0x00;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* gb = packed + (g * blocks + b) * gbb;
      for (int i = 0; i < 16; ++i) {
        uint8_t* dst = rows + (16 * g + i) * row_bytes + b * l.block_bytes;
        dst[0] = gb[2 * i];
        dst[1] = gb[2 * i + 1];
        if (l.source == kQ4_1) {
          dst[2] = gb[32 + 2 * i];
          dst[3] = gb[32 + 2 * i + 1];
        }
        for (int t = 0; t < l.code_vectors; ++t)
          for (int j = 0; j < 4; ++j)
            dst[l.codes_at + 4 * t + j] = gb[l.header_bytes + 64 * t + 4 * i + j] ^ flip;
      }
    }
  }
}

}  // namespace sparsekv_quant
