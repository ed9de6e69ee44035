// Torch operators of the multi-query paged attention kernel (chunk_paged.h):
//   chunk_paged_isas()                    variants this CPU runs, fastest first (comma-separated)
//   chunk_paged_isa_status(isa)           "ok" or why the CPU does not run it
//   chunk_paged_attention(query, key, value, kv_pool, block_tables, row_starts, num_cached,
//                         scale, window, isa) -> [out, lse]
// Registered as a fragment of the sparsekv_cpu library (binding.cpp holds the rest).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "chunk_paged.h"
#include "isa_select.h"
#include "run_items.h"

namespace skv = sparsekv_cpu;

namespace {

struct ChunkVariant {
  const char* name;
  const skv::ChunkKernel* kernel;
};

const ChunkVariant kChunkVariants[] = {  // fastest first
    {"avx512_amx", &skv::kChunkAvx512Amx},
    {"avx512_bf16", &skv::kChunkAvx512Bf16},
    {"avx512", &skv::kChunkAvx512},
    {"avx2", &skv::kChunkAvx2},
    {"generic", &skv::kChunkGeneric},
};

std::string chunk_status(const ChunkVariant& v) {
  if (v.kernel->item == nullptr) return "not compiled for this target";
  if (std::string(v.name) == "avx512_bf16") return skv::avx512_bf16_status();
  if (std::string(v.name) == "avx512_amx") return skv::amx_status();
  // Same CPU requirements as the decode variants of the same name.
  return skv::find_table(v.name) != nullptr ? "ok" : std::string("no ") + v.name + " on this CPU";
}

std::string chunk_paged_isa_status(c10::string_view isa) {
  for (const auto& v : kChunkVariants)
    if (isa == v.name) return chunk_status(v);
  return "no chunk kernel variant '" + std::string(isa) + "'";
}

std::string chunk_paged_isas() {
  std::string out;
  for (const auto& v : kChunkVariants)
    if (chunk_status(v) == "ok") out += (out.empty() ? "" : ",") + std::string(v.name);
  return out;
}

void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& pool, const at::Tensor& tables, const at::Tensor& row_starts,
                  const at::Tensor& num_cached, int64_t width) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "query, key and value must be 3-D [heads, rows, head_dim]");
  TORCH_CHECK(pool.dim() == 5 && pool.is_contiguous() && pool.size(1) == 2,
              "kv_pool must be a contiguous [num_pages, 2, num_kv_heads, block_size, head_dim]");
  for (const auto* t : {&query, &key, &value, &pool, &tables, &row_starts, &num_cached})
    TORCH_CHECK(t->device().is_cpu(), "all tensors must be on CPU");
  const auto pt = pool.scalar_type();
  TORCH_CHECK(pt == at::kFloat || pt == at::kBFloat16, "kv_pool must be float32 or bfloat16");
  TORCH_CHECK(key.scalar_type() == pt && value.scalar_type() == pt,
              "key and value must have kv_pool's dtype");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "query must be float32 or bfloat16");
  const int64_t H = query.size(0), rows = query.size(1), d = query.size(2);
  const int64_t kvh = pool.size(2);
  TORCH_CHECK(pool.size(4) == d, "head_dim of query and kv_pool differ");
  TORCH_CHECK(d > 0 && d <= 1024 && d % (2 * width) == 0, "head_dim must be a multiple of ",
              2 * width, " and at most 1024, got ", d);
  TORCH_CHECK(kvh > 0 && H % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(key.size(0) == kvh && key.size(1) == rows && key.size(2) == d &&
                  key.sizes() == value.sizes(),
              "key and value must be [num_kv_heads, rows, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1 && value.stride(2) == 1,
              "query, key and value rows must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.is_contiguous(),
              "block_tables must be a contiguous int64 [batch, max_blocks]");
  const int64_t batch = tables.size(0);
  TORCH_CHECK(row_starts.scalar_type() == at::kLong && row_starts.is_contiguous() &&
                  row_starts.numel() == batch + 1,
              "row_starts must be a contiguous int64 [batch + 1]");
  TORCH_CHECK(num_cached.scalar_type() == at::kLong && num_cached.is_contiguous() &&
                  num_cached.numel() == batch,
              "num_cached must be a contiguous int64 [batch]");
}

// Page ids and row ranges in bounds (a bad table would read outside the pool).
void check_tables(const at::Tensor& tables, const int64_t* starts, const int64_t* cached,
                  int64_t num_pages, int64_t block_size, int64_t rows) {
  const int64_t batch = tables.size(0), max_blocks = tables.size(1);
  const int64_t* t = tables.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[batch] == rows, "row_starts must run from 0 to rows");
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(starts[b + 1] >= starts[b], "row_starts must not decrease");
    const int64_t pages = (cached[b] + block_size - 1) / block_size;
    TORCH_CHECK(cached[b] >= 0 && pages <= max_blocks, "num_cached[", b,
                "] exceeds its block table");
    for (int64_t i = 0; i < pages; ++i)
      TORCH_CHECK(t[b * max_blocks + i] >= 0 && t[b * max_blocks + i] < num_pages,
                  "page id out of range in block_tables[", b, "]");
  }
}

// The work items (chunk_paged.h): per sequence, row blocks of about 32 rows over the group,
// per KV head; each cut into key splits when there are too few items to keep the threads busy.
// Returns the items and, per (sequence, KV head, row block), the index of its first item.
std::vector<skv::ChunkItem> make_items(const skv::ChunkArgs& a, int64_t batch,
                                       int64_t width, std::vector<int64_t>& groups,
                                       int64_t& state_floats, int64_t& work) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t block = std::max<int64_t>(1, 32 / group);
  struct Base {
    int64_t b, row0, num_rows, t0, t1;
  };
  std::vector<Base> bases;
  work = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t m = a.row_starts[b + 1] - a.row_starts[b], nc = a.num_cached[b];
    for (int64_t row0 = 0; row0 < m; row0 += block) {
      const int64_t n = std::min(block, m - row0), last = nc + row0 + n - 1;
      const int64_t first = a.window > 0 ? std::max<int64_t>(0, nc + row0 - a.window + 1) : 0;
      bases.push_back({b, row0, n, first / a.tile, last / a.tile + 1});
      work += 2 * group * n * (last + 1 - first) * a.head_dim * a.num_kv_heads;
    }
  }
  const int64_t num_base = (int64_t)bases.size() * a.num_kv_heads;
  const int64_t threads = work < skv::kParallelMinWork ? 1 : at::get_num_threads();
  const int64_t want = threads > 1 ? (4 * threads + num_base - 1) / num_base : 1;
  constexpr int64_t kMinTilesPerSplit = 8;
  std::vector<skv::ChunkItem> items;
  state_floats = 0;
  for (const auto& base : bases)
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      groups.push_back((int64_t)items.size());
      const int64_t tiles = base.t1 - base.t0;
      const int64_t splits = std::max<int64_t>(1, std::min(want, tiles / kMinTilesPerSplit));
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t lo = base.t0 + tiles * s / splits, hi = base.t0 + tiles * (s + 1) / splits;
        items.push_back({base.b, h, base.row0, base.num_rows, lo, hi, state_floats});
        state_floats += skv::chunk_state_floats(group * base.num_rows, a.head_dim, width);
      }
    }
  groups.push_back((int64_t)items.size());
  return items;
}

// Causal attention of each sequence's chunk of new rows over its held slots in the pages and
// its own keys (chunk_paged.h). query [num_heads, rows, head_dim] (fp32 or bf16), key / value
// [num_kv_heads, rows, head_dim] in kv_pool's dtype (fp32 or bf16), rows of all sequences
// concatenated (row_starts [batch + 1]); block_tables [batch, max_blocks], num_cached [batch]
// int64; window > 0: a sliding window of that many keys. Returns out [num_heads, rows,
// head_dim] in the query dtype and lse [num_heads, rows] fp32 (natural log).
std::vector<at::Tensor> chunk_paged_attention(const at::Tensor& query, const at::Tensor& key,
                                              const at::Tensor& value, const at::Tensor& kv_pool,
                                              const at::Tensor& block_tables,
                                              const at::Tensor& row_starts,
                                              const at::Tensor& num_cached, double scale,
                                              int64_t window, c10::string_view isa) {
  const ChunkVariant* variant = nullptr;
  for (const auto& v : kChunkVariants)
    if (isa == v.name) variant = &v;
  TORCH_CHECK(variant != nullptr, "no chunk kernel variant '", std::string(isa), "'");
  const std::string status = chunk_status(*variant);
  TORCH_CHECK(status == "ok", "the ", variant->name, " chunk kernel is unavailable: ", status);
  const skv::ChunkKernel& kernel = *variant->kernel;
  check_inputs(query, key, value, kv_pool, block_tables, row_starts, num_cached, kernel.width);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  const int64_t H = query.size(0), rows = query.size(1), d = query.size(2);
  const int64_t batch = block_tables.size(0);
  check_tables(block_tables, row_starts.data_ptr<int64_t>(), num_cached.data_ptr<int64_t>(),
               kv_pool.size(0), kv_pool.size(3), rows);
  auto out = at::empty({H, rows, d}, query.options());
  auto lse = at::empty({H, rows}, query.options().dtype(at::kFloat));
  if (rows == 0) return {out, lse};

  skv::ChunkArgs a{};
  a.query = query.data_ptr();
  a.query_head_stride = query.stride(0);
  a.query_row_stride = query.stride(1);
  a.query_bf16 = query.scalar_type() == at::kBFloat16;
  a.pool = kv_pool.data_ptr();
  a.pool_bf16 = kv_pool.scalar_type() == at::kBFloat16;
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  a.key_head_stride = key.stride(0);
  a.key_row_stride = key.stride(1);
  a.value_head_stride = value.stride(0);
  a.value_row_stride = value.stride(1);
  a.block_tables = block_tables.data_ptr<int64_t>();
  a.max_blocks = block_tables.size(1);
  a.row_starts = row_starts.data_ptr<int64_t>();
  a.num_cached = num_cached.data_ptr<int64_t>();
  a.num_heads = H;
  a.num_kv_heads = kv_pool.size(2);
  a.block_size = kv_pool.size(3);
  a.head_dim = d;
  a.scale = (float)scale;
  a.window = window;
  a.tile = a.pool_bf16 && kernel.bf16_tile > 0 ? kernel.bf16_tile : skv::kChunkTileKeys;
  a.total_rows = rows;
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();

  std::vector<int64_t> groups;
  int64_t state_floats = 0, work = 0;
  const auto items = make_items(a, batch, kernel.width, groups, state_floats, work);
  std::vector<float> states(state_floats);
  const int64_t group = H / a.num_kv_heads, max_rows = group * std::max<int64_t>(1, 32 / group);
  skv::run_dynamic((int64_t)items.size(), work, kernel.scratch(a, max_rows),
                   [&](int64_t i, float* buf) { kernel.item(a, items[i], buf, states.data()); });
  const int64_t num_groups = (int64_t)groups.size() - 1;
  skv::run_dynamic(num_groups, state_floats, 0, [&](int64_t g, float*) {
    kernel.combine(a, items.data() + groups[g], groups[g + 1] - groups[g], states.data());
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparsekv_cpu, m) {
  m.def("chunk_paged_isas", &chunk_paged_isas);
  m.def("chunk_paged_isa_status", &chunk_paged_isa_status);
  m.def("chunk_paged_attention", &chunk_paged_attention);
}
