// Plain-C++ interface between the torch binding and the per-ISA kernels.
//
// The ISA translation units (isa_*.cpp) include no torch or standard-library headers: each is
// compiled with its own `#pragma GCC target`, and an inline function or template shared with
// the binding could be merged by the linker into its AVX-512 copy and then run on a CPU without
// AVX-512. They see only these plain structs and raw pointers.
//
// Page layout (docs/design.md, "KV memory"): pool [num_pages, 2 (K, V), num_kv_heads, block_size, head_dim],
// contiguous; one head's slots of a page are contiguous rows of head_dim elements. bf16 elements
// are passed as their raw 16-bit patterns, fp8 (e4m3fn) codes as their 8-bit patterns.
// Quantized pools (int8, fp8) come with scales [num_pages, 2, num_kv_heads, block_size] fp32:
// element = code * scale of its (page, K/V, head, slot).
// int4 (KIVI) pools: codes [num_pages, 2, num_kv_heads, block_size, head_dim / 2] bytes (two
// per byte, the even element in the low nibble), keys per channel (key_scale, key_zero
// [num_pages, num_kv_heads, head_dim]) and values per slot (value_scale, value_zero
// [num_pages, num_kv_heads, block_size]), fp16 bit patterns: element = code * scale + zero.
#pragma once

#include <stdint.h>

namespace sparsekv_cpu {

// Element type of a decode pool.
enum KvType : int32_t {
  kKvFloat32 = 0,
  kKvBFloat16 = 1,
  kKvInt8 = 2,
  kKvFp8E4M3 = 3,
  kKvInt4 = 4
};

struct DecodeArgs {
  const void* query;            // [batch, num_heads, head_dim], fp32 or bf16 (query_bf16)
  const void* pool;             // [num_pages, 2, num_kv_heads, block_size, head_dim (int4: / 2)]
  const float* kv_scales;       // [num_pages, 2, num_kv_heads, block_size] (int8, fp8), else null
  // int4 pools (else null), fp16 bits: [num_pages, num_kv_heads, head_dim] key scales and
  // zeros, [num_pages, num_kv_heads, block_size] value scales and zeros.
  const uint16_t* key_scale;
  const uint16_t* key_zero;
  const uint16_t* value_scale;
  const uint16_t* value_zero;
  const int64_t* block_tables;  // [batch, max_blocks]
  int64_t max_blocks;
  int64_t num_heads, num_kv_heads, block_size, head_dim;
  float scale;
  float softcap;  // <= 0: none
  KvType kv_type;
  bool query_bf16;  // fp32 and bf16 pools: their own dtype; quantized pools: either
  // Outputs.
  void* out;         // [batch, num_heads, head_dim], query dtype
  float* lse;        // [batch, num_heads]
  float* scores;     // [batch, num_kv_heads, group, held_cap] raw logits, or nullptr
  float* mass;       // [batch, num_kv_heads, held_cap], zero-filled, or nullptr
  int64_t held_cap;  // max_blocks * block_size
};

// One unit of decode work: block-table entries [page_begin, page_end) of one (request, KV head).
// slot_lo/slot_hi is the request's visible logical slot range, first_slot its first held slot.
struct DecodeItem {
  int64_t b, kvh, page_begin, page_end, slot_lo, slot_hi, first_slot;
};

// Per-split partial state: for each query head of the group, [max, sum, acc[head_dim]] with
// logits in base 2 (log2(e) folded into the query scale).
// (static: an inline function with external linkage could be merged across ISA units.)
static inline int64_t decode_state_floats(int64_t group, int64_t head_dim) {
  return group * (head_dim + 2);
}

struct WindowArgs {
  const float* qt;   // [num_kv_heads, head_dim, rows] window queries * scale, transposed
  const float* lse;  // [num_kv_heads, rows]
  const float* thr;  // [rows] last slot a row sees (-1: padding row)
  const void* pool;
  const int64_t* block_table;  // [num_blocks]
  int64_t num_kv_heads, block_size, head_dim, num_slots;
  int64_t group;          // query heads per KV head
  int64_t rows_per_head;  // window rows padded to the vector width
  int64_t rows;           // group * rows_per_head, padded to the row block
  bool is_bf16;
  float* out;  // [num_kv_heads * group, num_slots]
  // Tables with window_bf16_pairs, for bf16 pools and queries only (else nullptr): the window
  // queries unscaled, rows as qt's, in pairs of head_dim elements (one 32-bit word each):
  // [num_kv_heads][rows / 16][head_dim / 32][16 pairs][16 rows]; logits are scaled by `scale`.
  const uint32_t* qpairs;
  float scale;
};

struct KernelTable {
  const char* name;
  int width;  // fp32 lanes of a vector; head_dim must be a multiple of 2 * width
  int window_slot_block;  // slots per register block of the window-score kernel
  int window_row_block;   // vectors per register block of the window-score kernel
  // Scratch floats one thread needs for decode_item / window_pages.
  int64_t (*decode_scratch)(const DecodeArgs&);
  int64_t (*window_scratch)(const WindowArgs&);
  // Partial attention of one item into `state` (decode_state_floats of them).
  void (*decode_item)(const DecodeArgs&, const DecodeItem&, float* scratch, float* state);
  // Merge the `num_splits` partial states of (b, kvh), write out/lse and, if asked, mass over
  // held slots [held_lo, held_hi).
  void (*decode_combine)(const DecodeArgs&, int64_t b, int64_t kvh, const float* states,
                         int64_t num_splits, int64_t held_lo, int64_t held_hi, float* scratch);
  // Window scores of the slots of block-table entries [page_begin, page_end) for one KV head.
  void (*window_pages)(const WindowArgs&, int64_t kvh, int64_t page_begin, int64_t page_end,
                       float* scratch);
  bool window_bf16_pairs;  // takes WindowArgs::qpairs (false where omitted)
};

extern const KernelTable kTableAvx512Amx;
extern const KernelTable kTableAvx512;
extern const KernelTable kTableAvx2;
extern const KernelTable kTableAvx2W16;
extern const KernelTable kTableGeneric;

}  // namespace sparsekv_cpu
