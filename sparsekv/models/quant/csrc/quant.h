// Plain-C++ interface between the torch binding and the per-ISA kernels of packed-weight
// linears (weights kept in a quantized block format, dequantized in registers).
//
// As in the fused ops (models/fused/csrc/fused.h), the ISA translation units include no torch
// or standard-library headers: each is compiled under its own `#pragma GCC target`, and an
// inline function shared with the binding could be merged by the linker into its AVX2 copy and
// then run on a CPU without AVX2. They see only these plain structs and raw pointers.
//
// A packed weight [n, k] is n rows of `row_bytes` bytes, one output feature per row; each row
// holds its k input-feature weights in one of the formats below (the GGML block layouts of
// llama.cpp's ggml-common.h for the GGUF ones).
#pragma once

#include <stdint.h>

namespace sparsekv_quant {

enum Format : int {
  kQ4_0 = 0,  // blocks of 32: fp16 d, 16 bytes of nibbles; w = d * (q - 8)
  kQ4_1 = 1,  // blocks of 32: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
  kQ8_0 = 2,  // blocks of 32: fp16 d, 32 int8; w = d * q
  kInt8Row = 3,  // one fp32 scale s, then k int8; w = s * q (per output channel)
  kBf16Row = 4,  // k bf16 bit patterns
  // Super-blocks of 256 (kquant_impl.h): fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales
  // and mins, 128 bytes of nibbles; w = d * sc * q - dmin * m per sub-block of 32.
  kQ4_K = 5,
  // Super-blocks of 256: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 sub-block
  // scales, fp16 d; w = d * scale * (q - 32) per sub-block of 16.
  kQ6_K = 6,
  kQ5_0 = 7,  // blocks of 32: fp16 d, 32-bit qh (fifth bits), 16 bytes of nibbles; w = d * (q - 16)
  // Q4_0 / Q4_1 / Q8_0 repacked in groups of 16 rows for the int8-activation kernels
  // (quant_x16_impl.h): a weight [n, k] is n / 16 group rows of k / 32 group-blocks, each the
  // 16 rows' fp16 d, then (Q4_1) their 16 fp16 m, then code vectors of 64 bytes whose 4-byte
  // word i is row i's code bytes 4t .. 4t + 3 (vector t; Q4: the block's nibble bytes, 4
  // vectors; Q8_0: its int8 codes + 128 as unsigned bytes, 8 vectors). Same bytes per value as
  // the source format.
  kQ4_0X16 = 8,
  kQ4_1X16 = 9,
  kQ8_0X16 = 10,
  kNumFormats = 11,
};

// Nibbles of a 4-bit block: byte j holds element j (low nibble) and element j + 16 (high).
constexpr int kBlock = 32;

// y[r, col + i] = sum_j W[i, j] * x[r, j] (+ bias[i]) for weight rows i in [begin, end) and all
// m rows r of x, with fp32 accumulation. The fp32 kernels (`gemv`, `gemm`) read `x` and write
// `y`; the bf16-activation kernels (`gemv_bf16`, `gemm_bf16`) read `x_bf16` and write `y` or,
// when set, `y_bf16` (the fp32 result rounded once to nearest even), adding `bias` first.
struct MatmulArgs {
  const uint8_t* w;  // [n, row_bytes]
  int64_t row_bytes;
  int format;
  const float* x;  // [m, k] fp32, row stride x_stride (nullptr for bf16 x)
  int64_t m, k, x_stride;
  // [m, k / 32] sums of x over each block of 32 (the Q4_0 / Q4_1 / Q4_K offsets factor out of
  // the dot product: sum (d q + c) x = d sum q x + c sum x), or nullptr for the other formats.
  const float* x_block_sums;
  float* y;  // [m, y_stride] fp32; this call writes columns col + [begin, end)
  int64_t y_stride, col;
  const uint16_t* x_bf16 = nullptr;  // [m, k] bf16 bit patterns, row stride x_stride
  uint16_t* y_bf16 = nullptr;        // [m, y_stride] bf16 bit patterns, instead of y
  const float* bias = nullptr;       // [n] fp32 (bf16 and int8 kernels only), or nullptr
  // bf16 x quantized per block of 32 for the int8-activation kernels (`gemm_q8`, `gemm_x16`;
  // quant_q8_impl.h): per row of x its k high codes, then its k residual codes (row stride
  // 2k), per block the unit u [m, k / 32] (x ~= u * (256 * high + residual)) and the sum of
  // 256 * high + residual over the block [m, k / 32]; x_block_sums then holds the exact fp32
  // block sums of x.
  const int8_t* x_q8 = nullptr;
  const float* x_q8_scales = nullptr;
  const int32_t* x_q8_sums = nullptr;
};

struct QuantTable {
  const char* name;
  int width;  // fp32 lanes of a vector; 0: not compiled for this target
  // One row of x (decode at batch 1): the 4-bit formats use x_block_sums.
  void (*gemv)(const MatmulArgs&, int64_t begin, int64_t end);
  // A few rows of x: each tile of weight rows is dequantized once (into a small buffer on the
  // stack, in L1) and multiplied with every row of x.
  void (*gemm)(const MatmulArgs&, int64_t begin, int64_t end);
  // out [n, k] fp32 <- weight rows [begin, end) dequantized (the prefill path's tiles).
  void (*dequantize)(const uint8_t* w, int64_t row_bytes, int format, int64_t k, float* out,
                     int64_t begin, int64_t end);
  // Formats whose bf16-activation kernels exist (bit 1 << format), and those kernels: one row
  // of x / a few rows. Q4_1 reads x_block_sums [m, k / 32]. 0 and nullptr: convert x to fp32.
  unsigned bf16_formats;
  void (*gemv_bf16)(const MatmulArgs&, int64_t begin, int64_t end);
  void (*gemm_bf16)(const MatmulArgs&, int64_t begin, int64_t end);
  // Formats whose int8-activation kernel exists (bit 1 << format; 0: none), taken before the
  // bf16 kernels for bf16 x: `quantize_x` fills rows [r_begin, r_end) of the MatmulArgs
  // x_q8 ([m, 2k]) / x_q8_scales / x_q8_sums / x_block_sums buffers from bf16 x [m, k] (row
  // stride `stride`), and `gemm_q8` multiplies any number of rows with them.
  unsigned q8_formats = 0;
  void (*quantize_x)(const uint16_t* x, int64_t stride, int64_t k, int64_t r_begin,
                     int64_t r_end, int8_t* q, float* scales, int32_t* sums,
                     float* x_sums) = nullptr;
  void (*gemm_q8)(const MatmulArgs&, int64_t begin, int64_t end) = nullptr;
  // The int8-activation kernel of the x16 formats (weight rows [begin, end), multiples of 16),
  // on the same quantized x, whose code buffer must hold rows up to the next multiple of 8
  // (zero codes: the AMX kernel's tile products read whole groups of 8 rows); nullptr where the
  // variant has none.
  void (*gemm_x16)(const MatmulArgs&, int64_t begin, int64_t end) = nullptr;
  // The passes around an int8 x int8 -> int32 matmul of many rows on per-channel int8 weights
  // (int8_rows_impl.h, int8_rows_avx2_impl.h); nullptr where the variant has none. `quantize_rows`:
  // rows [r_begin, r_end) of x [m, k] (bf16 bit patterns or fp32, row stride `stride`) into
  // int8 codes [m, k] and one scale per row. `scale_rows`: rows [r_begin, r_end) of y (bf16 or
  // fp32, row stride y_stride) = int32 products [m, n] * row scale * column scale (+ bias).
  void (*quantize_rows)(const void* x, bool bf16, int64_t stride, int64_t k, int64_t r_begin,
                        int64_t r_end, int8_t* q, float* scales) = nullptr;
  void (*scale_rows)(const int32_t* acc, int64_t n, int64_t r_begin, int64_t r_end,
                     const float* row_scale, const float* col_scale, const float* bias, void* y,
                     bool bf16, int64_t y_stride) = nullptr;
  // `scale_rows` of a fused gate / up projection: products [m, 2n] (gate, then up) to
  // y [m, n] = act(gate) * up (act 0: SiLU, 1: tanh GELU).
  void (*scale_rows_gated)(const int32_t* acc, int64_t n, int64_t r_begin, int64_t r_end,
                           const float* row_scale, const float* col_scale, const float* bias,
                           void* y, bool bf16, int64_t y_stride, int act) = nullptr;
};

extern const QuantTable kQuantAvx512Amx;
extern const QuantTable kQuantAvx512Vnni;
extern const QuantTable kQuantAvx512Bf16;
extern const QuantTable kQuantAvx2;
extern const QuantTable kQuantGeneric;

}  // namespace sparsekv_quant
