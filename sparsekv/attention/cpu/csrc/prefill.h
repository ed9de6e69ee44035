// Plain-C++ interface of the causal prefill (flash) attention kernels between the torch binding
// and the ISA units: AMX tiles (isa_avx512_amx.cpp, prefill_amx.h), AVX512-BF16 dot products
// (isa_avx512_bf16.cpp, prefill_bf16.h) and fp32 FMAs on AVX-512F, AVX2 or the compiler's
// baseline ISA (isa_avx512.cpp, isa_avx2.cpp, isa_generic.cpp, prefill_fma.h);
// plain structs and raw pointers only, for the reasons given in kernels.h.
//
// Layout. Query row i of head h sits at key index nk - nq + i and sees keys j <= nk - nq + i
// (bottom-right causal alignment), with a sliding window only those with
// j > nk - nq + i - window; query head h reads KV head h / group. The binding hands
// each kernel K and V rearranged for whole key blocks (nkp, a multiple of kPrefillKeyBlock,
// keys; those past nk are zero), per KV head:
//   AMX, cut into 1 KiB tiles:
//     key     [kvh][nkp / 16][head_dim / 32][16 keys][32 elements]   (A tiles of the logits)
//     value_t [kvh][nkp / 32][head_dim][32 keys]                      (A tiles of the values)
//   AVX512-BF16, bf16:
//     key     [kvh][nkp][head_dim]                                     (rows as they are)
//     value_t [kvh][nkp / 2][head_dim][2 keys]     (the rows of keys 2p and 2p + 1 interleaved)
//   AVX512-BF16 with int8 Q·K^T (prefill_qk8.h): value_t as above, and instead of key
//     key_codes  [kvh][nkp][head_dim] bytes, int8 codes of the smoothed keys + 128
//     key_scales [kvh][nkp]            fp32, one per key (0 past nk)
//   AVX-512F, AVX2, generic (key_f32, value_f32 instead, fp32):
//     key_f32, value_f32 [kvh][nkp][head_dim]
// The fp32 kernels also take fp32 queries and write fp32 outputs (query_f32, out_f32 set; the
// bf16 query and out then unused): the prefill of fp32 models, exact fp32 throughout.
#pragma once

#include <stdint.h>

namespace sparsekv_cpu {

constexpr int64_t kPrefillKeyBlock = 64;  // keys per online-softmax step

struct PrefillArgs {
  const uint16_t* query;    // [num_heads, nq, head_dim] bf16 bits, element stride 1
  int64_t query_head_stride, query_row_stride;  // in elements (a transposed view is fine)
  const uint16_t* key;      // bf16 bits, as above (AMX, AVX512-BF16)
  const uint16_t* value_t;  // bf16 bits, as above (AMX, AVX512-BF16)
  int64_t num_heads, num_kv_heads, nq, nk, nkp, head_dim;
  int64_t query_block;  // query rows (per head) of one work item, a multiple of 16
  float scale;
  int64_t window;  // sliding window in keys (Gemma 3 local layers), 0: none
  uint16_t* out;  // [num_heads, nq, head_dim] bf16 bits
  float* lse;     // [num_heads, nq] natural log
  const float* key_f32;    // fp32, as above (AVX-512F, AVX2)
  const float* value_f32;  // fp32, as above (AVX-512F, AVX2)
  const float* query_f32;  // fp32 queries instead of `query` (same strides), or nullptr
  float* out_f32;          // fp32 output instead of `out`, or nullptr (set with query_f32)
  const uint8_t* key_codes;  // int8 Q·K^T only, as above
  const float* key_scales;   // int8 Q·K^T only, as above
  const float* key_means;    // int8 Q·K^T only: [kvh][head_dim], subtracted from the keys
};

struct PrefillKernel {
  // Scratch floats one thread needs for prefill_item; nullptr: not compiled.
  int64_t (*scratch)(const PrefillArgs&);
  // Attention of query rows [qb * query_block, ...) of every head of KV head kvh's group.
  void (*item)(const PrefillArgs&, int64_t kvh, int64_t qb, float* scratch);
};

// The AVX512-BF16 kernel with int8 Q·K^T (prefill_qk8.h): `item` reads key_codes /
// key_scales, which the binding fills per KV head with `key_means` (the channel means of its
// nk key rows of d bf16, row stride s1) and `quantize_keys` (rows [j0, j1) of nkp, smoothed by
// those means). d <= 256.
struct PrefillQk8Kernel {
  int64_t (*scratch)(const PrefillArgs&);
  void (*item)(const PrefillArgs&, int64_t kvh, int64_t qb, float* scratch);
  void (*key_means)(const uint16_t* key, int64_t s1, int64_t nk, int64_t d, float* mean);
  void (*quantize_keys)(const uint16_t* key, int64_t s1, int64_t j0, int64_t j1, int64_t nk,
                        int64_t d, const float* mean, uint8_t* codes, float* scales);
};

// The kernels (every pointer null where a unit is not compiled). The caller checks that the CPU
// runs a kernel before calling it (isa_select.h: amx_status, cpu_runs).
extern const PrefillKernel kPrefillAmx;
extern const PrefillKernel kPrefillBf16;
extern const PrefillQk8Kernel kPrefillBf16Qk8;
extern const PrefillKernel kPrefillAvx512;
extern const PrefillKernel kPrefillAvx2;
extern const PrefillKernel kPrefillGeneric;

}  // namespace sparsekv_cpu
