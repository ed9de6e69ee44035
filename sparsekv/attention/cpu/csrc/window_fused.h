// Plain-C++ interface of the fused window-score kernels between the torch binding and the AMX
// unit (isa_avx512_amx.cpp, window_fused_amx.h), the AVX512-BF16 unit (isa_avx512_bf16.cpp,
// window_fused_bf16.h) or the fp32-FMA units (isa_avx2_w16.cpp and isa_generic.cpp,
// window_fused_fma.h); plain structs and raw pointers only, for the reasons given in kernels.h.
//
// What it computes, per KV head k with query heads h = k * group .. (k + 1) * group - 1 and
// window rows i = 0 .. w - 1 (row i is position n - w + i and sees keys j <= n - w + i):
//   lse[h, i]  = log sum_j exp(q[h, i] . key[k, j] * scale)                 (if not given)
//   out[h, j]  = sum_i exp(q[h, i] . key[k, j] * scale - lse[h, i])
// SnapKV's summed window attention (docs/compression.md) and its softmax denominators in
// one kernel: the logits of a KV head's group x w rows are computed once on AMX tiles into a
// cache-resident buffer, and each visible logit takes one exponential (the window-score
// kernel plus a separate LSE pass take two, and an attention call for the LSE also multiplies
// the values).
//
// Keys are read in blocks of 16 rows through a table of block pointers, so the same kernel
// reads a dense [kv_heads, n, head_dim] tensor or paged K/V in place (one block per 16 slots
// of a page's head run). The fp32-FMA kernels also take fp32 keys and queries (key_blocks_f32 and
// query_f32 set instead of key_blocks and query): the scoring of fp32 models.
#pragma once

#include <stdint.h>

namespace sparsekv_cpu {

struct WindowFusedArgs {
  const uint16_t* const* key_blocks;  // [num_kv_heads][num_blocks] -> 16 key rows (bf16 bits)
  int64_t key_row_stride;             // elements between consecutive key rows of a block
  const uint16_t* query;              // [num_kv_heads * group, w, head_dim] bf16 bits
  int64_t query_head_stride, query_row_stride;  // in elements; element stride 1
  const float* lse_in;  // [num_heads, w] natural log, or nullptr to compute it
  int64_t num_kv_heads, group, w, n, num_blocks, head_dim;
  int64_t rows;  // group * w rounded up to 16
  float scale;
  float* out;      // [num_heads, n]
  float* lse_out;  // [num_heads, w]
  const float* const* key_blocks_f32;  // fp32 key blocks instead of key_blocks, or nullptr
  const float* query_f32;  // fp32 queries instead of query (same strides), or nullptr
};

struct WindowFusedKernel {
  // Scratch floats one thread needs for item; nullptr: not compiled.
  int64_t (*scratch)(const WindowFusedArgs&);
  // Scores (and LSE) of every query head of KV head kvh.
  void (*item)(const WindowFusedArgs&, int64_t kvh, float* scratch);
};

// The kernels: AMX-BF16 tiles (window_fused_amx.h), AVX512-BF16 dot products
// (window_fused_bf16.h), fp32 FMAs on AVX2 and on the baseline ISA (window_fused_fma.h); both
// pointers null where a unit is not compiled. The caller checks amx_status(),
// avx512_bf16_status() == "ok" or find_table("avx2") before calling one.
extern const WindowFusedKernel kWindowFusedAmx;
extern const WindowFusedKernel kWindowFusedBf16;
extern const WindowFusedKernel kWindowFusedAvx2;
extern const WindowFusedKernel kWindowFusedGeneric;

}  // namespace sparsekv_cpu
