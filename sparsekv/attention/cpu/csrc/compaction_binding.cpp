// Torch operators of decode-time compaction (attention/compaction.py) and of the compressors'
// selection (compression/base.py):
//   move_slots_(pool, source, target, kept)
//   write_kept_slots_(pool, table, keys, values, kept)
//   kept_indices_prefer_recent(scores, k) -> kept
// For each (layer, KV head), kept slot j's key and value rows go to slot j of the layer's
// target pages. One item per (layer, KV head) on the intra-op threads; rows are copied in
// ascending j, so an in-place move (target = source's first pages) is safe when kept is
// ascending per row: slot j is read (as kept[j'] = j, j' <= j) before it is written. Runs of
// consecutive kept slots within one source and one target page move as one memmove (a
// 28-layer SmolLM2 compaction, 1040 to 1024 slots: ~3.2 ms against ~4.3 ms row by row), rows
// in place not at all; source pages are prefetched two ahead (~2.6 ms against ~3.2 ms). write_kept_slots_ is the same copy
// at prefill, from the dense new keys and values instead of pages: one copy where gathering the
// kept rows and then writing them to pages took two.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// Source pages fetched ahead of the copy: each page's head run is one short contiguous span at
// a random address, which the hardware prefetchers do not anticipate.
constexpr int64_t kPrefetchPages = 2;

// Rows of the page pool both operators write, checked to be a contiguous CPU
// [num_pages, 2, num_kv_heads, block_size, head_dim] tensor: (page, half, head, slot) -> bytes.
struct PoolRows {
  char* base;
  int64_t pages, kvh, bs, row_bytes;

  explicit PoolRows(const at::Tensor& pool) {
    TORCH_CHECK(pool.device().is_cpu() && pool.dim() == 5 && pool.size(1) == 2 &&
                    pool.is_contiguous(),
                "kv_pool must be a contiguous CPU [num_pages, 2, num_kv_heads, block, head_dim]");
    base = static_cast<char*>(pool.data_ptr());
    pages = pool.size(0), kvh = pool.size(2), bs = pool.size(3);
    row_bytes = pool.size(4) * pool.element_size();
  }
  char* operator()(int64_t page, int64_t half, int64_t head, int64_t slot) const {
    return base + (((page * 2 + half) * kvh + head) * bs + slot) * row_bytes;
  }
};

// Length of the run of consecutive slot indices starting at kept_row[j], at most `most`.
inline int64_t run_length(const int64_t* kept_row, int64_t j, int64_t most) {
  int64_t run = 1;
  while (run < most && kept_row[j + run] == kept_row[j] + run) ++run;
  return run;
}

void move_slots_(const at::Tensor& pool, const at::Tensor& source, const at::Tensor& target,
                 const at::Tensor& kept) {
  const PoolRows row(pool);
  TORCH_CHECK(source.scalar_type() == at::kLong && target.scalar_type() == at::kLong &&
                  kept.scalar_type() == at::kLong,
              "source, target and kept must be int64");
  TORCH_CHECK(source.dim() == 2 && target.dim() == 2 && kept.dim() == 3 &&
                  source.is_contiguous() && target.is_contiguous() && kept.is_contiguous(),
              "source [layers, blocks], target [layers, blocks], kept [layers, kv_heads, k]: "
              "contiguous");
  const int64_t pages = row.pages, kvh = row.kvh, bs = row.bs, row_bytes = row.row_bytes;
  const int64_t layers = kept.size(0), k = kept.size(2);
  TORCH_CHECK(kept.size(1) == kvh, "kept has ", kept.size(1), " heads, the pool ", kvh);
  TORCH_CHECK(source.size(0) == layers && target.size(0) == layers, "one table per layer");
  TORCH_CHECK(target.size(1) * bs >= k, "target pages hold fewer than ", k, " slots");
  const int64_t* src_table = source.data_ptr<int64_t>();
  const int64_t* dst_table = target.data_ptr<int64_t>();
  const int64_t* slots = kept.data_ptr<int64_t>();
  for (int64_t i = 0; i < layers * kvh * k; ++i) {
    const int64_t s = slots[i];
    TORCH_CHECK(s >= 0 && s < source.size(1) * bs, "kept slot ", s, " outside the source table");
  }
  for (int64_t i = 0; i < layers * source.size(1); ++i)
    TORCH_CHECK(src_table[i] >= 0 && src_table[i] < pages, "page id out of range");
  for (int64_t i = 0; i < layers * target.size(1); ++i)
    TORCH_CHECK(dst_table[i] >= 0 && dst_table[i] < pages, "page id out of range");
  const int64_t grain = layers * kvh * k * row_bytes < (int64_t(1) << 20) ? layers * kvh : 1;
  at::parallel_for(0, layers * kvh, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t l = item / kvh, h = item % kvh;
      const int64_t* kept_row = slots + item * k;
      const int64_t* src = src_table + l * source.size(1);
      const int64_t* dst = dst_table + l * target.size(1);
      for (int64_t j = 0, run = 1, fetched = -1; j < k; j += run) {
        const int64_t s = kept_row[j];
        if (s / bs + kPrefetchPages < source.size(1) && s / bs > fetched) {
          // The head's rows of a page ahead (pages lie anywhere; see kPrefetchPages).
          fetched = s / bs;
          for (int64_t half = 0; half < 2; ++half) {
            const char* ahead = row(src[fetched + kPrefetchPages], half, h, 0);
            for (int64_t o = 0; o < bs * row_bytes; o += 64) __builtin_prefetch(ahead + o, 0, 3);
          }
        }
        const int64_t sp = src[s / bs], so = s % bs, dp = dst[j / bs], dof = j % bs;
        // Consecutive kept slots that stay within both pages move as one block of rows.
        const int64_t most = std::min({bs - so, bs - dof, k - j});
        run = run_length(kept_row, j, most);
        if (sp == dp && so == dof) continue;  // already in place
        for (int64_t half = 0; half < 2; ++half)
          std::memmove(row(dp, half, h, dof), row(sp, half, h, so), run * row_bytes);
      }
    }
  });
}

// Slot j of the table's pages gets row kept[h, j] of keys[h] and of values[h], for every KV head
// h; slots past k in the last page are left as they were. Runs of consecutive kept rows that
// stay within one target page go as one memcpy when the rows are packed (row stride head_dim).
void write_kept_slots_(const at::Tensor& pool, const at::Tensor& table, const at::Tensor& keys,
                       const at::Tensor& values, const at::Tensor& kept) {
  const PoolRows row(pool);
  const int64_t pages = row.pages, kvh = row.kvh, bs = row.bs, d = pool.size(4);
  TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu() && keys.dim() == 3 &&
                  keys.sizes() == values.sizes() && keys.size(0) == kvh && keys.size(2) == d &&
                  keys.stride(2) == 1 && values.stride(2) == 1,
              "keys and values must be CPU [num_kv_heads, n, head_dim] with unit last stride, "
              "shaped as the pool's heads and rows");
  TORCH_CHECK(keys.scalar_type() == pool.scalar_type() &&
                  values.scalar_type() == pool.scalar_type(),
              "keys and values must have the pool's dtype");
  TORCH_CHECK(table.scalar_type() == at::kLong && kept.scalar_type() == at::kLong &&
                  table.dim() == 1 && kept.dim() == 2 && table.is_contiguous() &&
                  kept.is_contiguous() && kept.size(0) == kvh,
              "table [blocks] and kept [num_kv_heads, k] must be contiguous int64");
  const int64_t n = keys.size(1), k = kept.size(1), num_blocks = table.size(0);
  TORCH_CHECK(num_blocks * bs >= k, "table pages hold fewer than ", k, " slots");
  const int64_t* dst_table = table.data_ptr<int64_t>();
  const int64_t* slots = kept.data_ptr<int64_t>();
  for (int64_t i = 0; i < kvh * k; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < n, "kept slot ", slots[i], " outside the ", n, " rows");
  for (int64_t i = 0; i < (k + bs - 1) / bs; ++i)
    TORCH_CHECK(dst_table[i] >= 0 && dst_table[i] < pages, "page id out of range");
  const int64_t row_bytes = row.row_bytes;
  const char* sources[2] = {static_cast<const char*>(keys.data_ptr()),
                            static_cast<const char*>(values.data_ptr())};
  const int64_t head_stride[2] = {keys.stride(0) * keys.element_size(),
                                  values.stride(0) * values.element_size()};
  const int64_t row_stride[2] = {keys.stride(1) * keys.element_size(),
                                 values.stride(1) * values.element_size()};
  const int64_t grain = 2 * kvh * k * row_bytes < (int64_t(1) << 20) ? 2 * kvh : 1;
  // One item per (K/V half, KV head).
  at::parallel_for(0, 2 * kvh, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t half = item / kvh, h = item % kvh;
      const int64_t* kept_row = slots + h * k;
      const char* src = sources[half] + h * head_stride[half];
      const int64_t stride = row_stride[half];
      for (int64_t j = 0, run = 1; j < k; j += run) {
        const int64_t s = kept_row[j], offset = j % bs;
        const int64_t most = std::min(bs - offset, k - j);
        run = run_length(kept_row, j, most);
        char* dst = row(dst_table[j / bs], half, h, offset);
        if (stride == row_bytes) {
          std::memcpy(dst, src + s * stride, run * row_bytes);
        } else {
          for (int64_t r = 0; r < run; ++r)
            std::memcpy(dst + r * row_bytes, src + (s + r) * stride, row_bytes);
        }
      }
    }
  });
}

// Ascending order with every NaN above every number and NaNs equal (kthvalue's and sort's).
inline bool ranks_below(float a, float b) { return a < b || (!std::isnan(a) && std::isnan(b)); }

// Per row of scores [rows, m] fp32: the k slots left after dropping the m - k lowest scores,
// ties at the cutoff dropping the oldest (lowest index) first; [rows, k] int64, ascending.
at::Tensor kept_indices_prefer_recent(const at::Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat &&
                  scores.dim() == 2 && scores.is_contiguous(),
              "scores must be contiguous float32 [rows, m] on CPU");
  const int64_t rows = scores.size(0), m = scores.size(1), num_drop = m - k;
  TORCH_CHECK(k > 0 && num_drop > 0, "need 0 < k < m, got k ", k, " and m ", m);
  auto kept = at::empty({rows, k}, scores.options().dtype(at::kLong));
  const float* all = scores.data_ptr<float>();
  int64_t* out = kept.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / m);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> order(m);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = all + r * m;
      order.assign(row, row + m);
      // Few to drop (decode-time compaction: 16 of ~1000): a heap of the lowest, one
      // well-predicted compare per slot; else quickselect.
      if (num_drop * 16 <= m)
        std::partial_sort(order.begin(), order.begin() + num_drop, order.end(), ranks_below);
      else
        std::nth_element(order.begin(), order.begin() + num_drop - 1, order.end(), ranks_below);
      const float cutoff = order[num_drop - 1];
      int64_t quota = num_drop;  // slots at the cutoff to drop: num_drop less those below it
      for (int64_t j = 0; j < m; ++j) quota -= ranks_below(row[j], cutoff);
      int64_t* dst = out + r * k;
      for (int64_t j = 0; j < m; ++j) {
        const bool below = ranks_below(row[j], cutoff);
        const bool at = !below && !ranks_below(cutoff, row[j]);
        if (below || (at && quota-- > 0)) continue;
        *dst++ = j;
      }
    }
  });
  return kept;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparsekv_cpu, m) {
  m.def("move_slots_(Tensor(a!) pool, Tensor source, Tensor target, Tensor kept) -> ()",
        &move_slots_);
  m.def(
      "write_kept_slots_(Tensor(a!) pool, Tensor table, Tensor keys, Tensor values, Tensor kept) "
      "-> ()",
      &write_kept_slots_);
  m.def("kept_indices_prefer_recent", &kept_indices_prefer_recent);
}
