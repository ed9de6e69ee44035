// Plain-C++ interface of the causal prefill (flash) attention kernel between the torch binding
// and the AMX unit (isa_avx512_amx.cpp, prefill_amx.h); plain structs and raw pointers only,
// for the reasons given in kernels.h.
//
// Layout. Query row i of head h sits at key index nk - nq + i and sees keys j <= nk - nq + i
// (bottom-right causal alignment), with a sliding window only those with
// j > nk - nq + i - window; query head h reads KV head h / group. The binding hands
// the kernel K and V cut into AMX tiles, each 1 KiB contiguous, for whole key blocks (nkp, a
// multiple of kPrefillKeyBlock, keys; those past nk are zero):
//   key     [kvh][nkp / 16][head_dim / 32][16 keys][32 elements]   (A tiles of the logits)
//   value_t [kvh][nkp / 32][head_dim][32 keys]                      (A tiles of the values)
#pragma once

#include <stdint.h>

namespace sparsekv_cpu {

constexpr int64_t kPrefillKeyBlock = 64;  // keys per online-softmax step

struct PrefillArgs {
  const uint16_t* query;    // [num_heads, nq, head_dim] bf16 bits, element stride 1
  int64_t query_head_stride, query_row_stride;  // in elements (a transposed view is fine)
  const uint16_t* key;      // bf16 bits, tiles as above
  const uint16_t* value_t;  // bf16 bits, tiles as above
  int64_t num_heads, num_kv_heads, nq, nk, nkp, head_dim;
  int64_t query_block;  // query rows (per head) of one work item, a multiple of 16
  float scale;
  int64_t window;  // sliding window in keys (Gemma 3 local layers), 0: none
  uint16_t* out;  // [num_heads, nq, head_dim] bf16 bits
  float* lse;     // [num_heads, nq] natural log
};

struct PrefillKernel {
  // Scratch floats one thread needs for prefill_item; nullptr: not compiled.
  int64_t (*scratch)(const PrefillArgs&);
  // Attention of query rows [qb * query_block, ...) of every head of KV head kvh's group.
  void (*item)(const PrefillArgs&, int64_t kvh, int64_t qb, float* scratch);
};

// The AMX-BF16 kernel (both pointers null where the AMX unit is not compiled). The caller
// checks amx_status() == "ok" before calling it.
extern const PrefillKernel kPrefillAmx;

}  // namespace sparsekv_cpu
