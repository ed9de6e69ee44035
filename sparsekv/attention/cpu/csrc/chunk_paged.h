// Plain-C++ interface of the multi-query paged attention kernel (chunk_paged_impl.h) between
// its torch binding (chunk_paged_binding.cpp) and the ISA units (chunk_paged_<isa>.cpp); plain
// structs and raw pointers only, for the reasons given in kernels.h.
//
// A batch of sequences, each a chunk of m_b new query rows (speculative verification: the
// K + 1 rows of a draft; chunked prefill: one chunk of a prompt) after num_cached[b] slots held
// in pages. Row i of sequence b sits at key index num_cached[b] + i and sees key j iff
// j <= num_cached[b] + i and, with a sliding window w, j > num_cached[b] + i - w. Keys
// j < num_cached[b] are read in place from the pages of block_tables[b] (slot j at entry
// j / block_size, offset j % block_size); keys num_cached[b] + t are the chunk's own rows t of
// key / value. Query head h reads KV head h / group; K/V are never expanded.
//
// Work: an item is (sequence, KV head, block of query rows, range of key tiles); it writes a
// partial state per row (base-2 max, sum, accumulator in the kernel's chunk order) and
// chunk_combine merges the items of one (sequence, KV head, row block) into out and lse.
#pragma once

#include <stdint.h>

namespace sparsekv_cpu {

struct ChunkArgs {
  const void* query;  // [num_heads, rows] of head_dim elements (strides below), fp32 or bf16
  int64_t query_head_stride, query_row_stride;  // in elements
  bool query_bf16;
  const void* pool;  // [num_pages, 2, num_kv_heads, block_size, head_dim], fp32 or bf16
  bool pool_bf16;    // also the element type of key / value
  const void* key;   // [num_kv_heads, rows] of head_dim elements, the chunks' own keys
  const void* value;
  int64_t key_head_stride, key_row_stride, value_head_stride, value_row_stride;
  const int64_t* block_tables;  // [batch, max_blocks]
  int64_t max_blocks;
  const int64_t* row_starts;  // [batch + 1] first row of each sequence (rows are concatenated)
  const int64_t* num_cached;  // [batch]
  int64_t num_heads, num_kv_heads, block_size, head_dim;
  float scale;     // softmax scale (natural logits)
  int64_t window;  // sliding window in keys, 0: none
  int64_t tile;    // keys per online-softmax step (a multiple of the vector width)
  int64_t total_rows;  // row_starts[batch]
  void* out;       // [num_heads, total_rows, head_dim], query dtype
  float* lse;      // [num_heads, total_rows], natural log
};

// Rows [row0, row0 + num_rows) of sequence b (chunk rows, per head of KV head kvh's group)
// against the key tiles [tile_begin, tile_end) (tile t: keys [t * tile, (t + 1) * tile)).
// state: offset in floats of the item's partial state (chunk_state_floats).
struct ChunkItem {
  int64_t b, kvh, row0, num_rows, tile_begin, tile_end, state;
};

// Keys per tile of the rows-in-lanes path (chunk_paged_impl.h): with the tile widened to fp32
// (K and V, head_dim 128: 16 KiB) it stays in L1 beside the logits and the accumulators; 32 keys
// measured slower on Zen 4 (32 KiB L1). A multiple of every variant's width.
constexpr int64_t kChunkTileKeys = 16;
// Keys per tile over bf16 pages with AVX512-BF16 dot products (chunk_paged_bf16.h): nothing is
// widened, and a longer tile halves the per-tile work (pointer setup, the online-softmax
// rescale of the accumulator, the pair packing).
constexpr int64_t kChunkTileKeysBf16 = 32;

// Floats of one item's partial state for `rows` rows (group * num_rows) on a kernel of `width`
// lanes: rows padded to whole vectors, times head_dim + 2 (max, sum, accumulator).
static inline int64_t chunk_state_floats(int64_t rows, int64_t head_dim, int64_t width) {
  return (rows + width - 1) / width * width * (head_dim + 2);
}

struct ChunkKernel {
  int width;  // fp32 lanes; head_dim must be a multiple of 2 * width; 0: not compiled
  int bf16_tile;  // keys per tile over bf16 pages (0: kChunkTileKeys)
  // Scratch floats one thread needs for chunk_item with `rows` rows (group * num_rows).
  int64_t (*scratch)(const ChunkArgs&, int64_t rows);
  void (*item)(const ChunkArgs&, const ChunkItem&, float* scratch, float* states);
  // Merge the partial states of items [first, first + count) (one sequence, KV head and row
  // block, in any key order) into out / lse.
  void (*combine)(const ChunkArgs&, const ChunkItem* items, int64_t count, const float* states);
};

extern const ChunkKernel kChunkAvx512Amx;
extern const ChunkKernel kChunkAvx512Bf16;
extern const ChunkKernel kChunkAvx512;
extern const ChunkKernel kChunkAvx2;
extern const ChunkKernel kChunkGeneric;

}  // namespace sparsekv_cpu
