// Torch operators of the paged CPU kernels (torch.ops.sparsekv_cpu.*): argument checks, work
// planning, threading. Registered with TORCH_LIBRARY and light ATen headers rather than
// torch/extension.h, which alone costs ~45 s of compile time.
//
// Work is split into items of whole pages of one (request, KV head) (flash-decoding style
// splits, merged by log-sum-exp afterwards), sorted longest first and handed out dynamically to
// the intra-op threads, so ragged batches and batch-1 decode keep every core busy.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "isa_select.h"
#include "kernels.h"
#include "run_items.h"

namespace skv = sparsekv_cpu;
using skv::run_dynamic;

namespace {

std::string available_isas() {  // comma-separated, fastest first
  std::string out;
  for (const auto& isa : skv::supported_isas()) out += (out.empty() ? "" : ",") + isa;
  return out;
}

const skv::KernelTable& table_for(c10::string_view isa_name) {
  const std::string isa(isa_name);
  const skv::KernelTable* table = skv::find_table(isa);
  TORCH_CHECK(table != nullptr, "kernel variant '", isa, "' is not supported on this CPU");
  return *table;
}

constexpr int64_t kWindowMaxPages = 8;  // block-table entries per window-score work item

void check_pool(const at::Tensor& pool) {
  TORCH_CHECK(pool.device().is_cpu(), "kv_pool must be on CPU");
  TORCH_CHECK(pool.dim() == 5 && pool.size(1) == 2,
              "kv_pool must be [num_pages, 2, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(pool.is_contiguous(), "kv_pool must be contiguous");
  TORCH_CHECK(pool.scalar_type() == at::kFloat || pool.scalar_type() == at::kBFloat16,
              "kv_pool must be float32 or bfloat16");
}

// Codes and scales of an int8 / fp8 pool; returns the kernel's element type.
skv::KvType check_quantized_pool(const at::Tensor& data, const at::Tensor& scales) {
  TORCH_CHECK(data.device().is_cpu() && scales.device().is_cpu(),
              "kv_data and kv_scales must be on CPU");
  TORCH_CHECK(data.dim() == 5 && data.size(1) == 2,
              "kv_data must be [num_pages, 2, num_kv_heads, block_size, head_dim], got ",
              data.sizes());
  TORCH_CHECK(data.scalar_type() == at::kChar || data.scalar_type() == at::kFloat8_e4m3fn,
              "kv_data must be int8 or float8_e4m3fn, got ", data.scalar_type());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "kv_scales must be float32, got ",
              scales.scalar_type());
  TORCH_CHECK(scales.sizes() == data.sizes().slice(0, 4),
              "kv_scales must be [num_pages, 2, num_kv_heads, block_size] = ",
              data.sizes().slice(0, 4), " for kv_data of shape ", data.sizes(), ", got ",
              scales.sizes());
  TORCH_CHECK(data.is_contiguous() && scales.is_contiguous(),
              "kv_data and kv_scales must be contiguous");
  return data.scalar_type() == at::kChar ? skv::kKvInt8 : skv::kKvFp8E4M3;
}

// Codes and fp16 scales and zeros of a KIVI int4 pool (kernels.h).
void check_int4_pool(const at::Tensor& codes, const at::Tensor& key_scale,
                        const at::Tensor& key_zero, const at::Tensor& value_scale,
                        const at::Tensor& value_zero) {
  TORCH_CHECK(codes.dim() == 5 && codes.size(1) == 2,
              "codes must be [num_pages, 2, num_kv_heads, block_size, head_dim / 2], got ",
              codes.sizes());
  TORCH_CHECK(codes.scalar_type() == at::kByte, "codes must be uint8, got ",
              codes.scalar_type());
  const int64_t pages = codes.size(0), kvh = codes.size(2), bs = codes.size(3);
  const int64_t d = 2 * codes.size(4);
  const std::pair<const at::Tensor*, const char*> params[4] = {
      {&key_scale, "key_scale"}, {&key_zero, "key_zero"},
      {&value_scale, "value_scale"}, {&value_zero, "value_zero"}};
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& t = *params[i].first;
    const char* name = params[i].second;
    const std::vector<int64_t> want = {pages, kvh, i < 2 ? d : bs};
    TORCH_CHECK(t.scalar_type() == at::kHalf, name, " must be float16, got ", t.scalar_type());
    TORCH_CHECK(t.sizes() == at::IntArrayRef(want), name, " must be ",
                i < 2 ? "[num_pages, num_kv_heads, head_dim] = " :
                        "[num_pages, num_kv_heads, block_size] = ",
                at::IntArrayRef(want), " for codes of shape ", codes.sizes(), ", got ", t.sizes());
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be contiguous on CPU");
  }
  TORCH_CHECK(codes.device().is_cpu() && codes.is_contiguous(),
              "codes must be contiguous on CPU");
}

int64_t vector_width(c10::string_view isa) { return table_for(isa).width; }

// Work of one decode call: items of whole pages of one (request, KV head), at most chunk_pages
// each (flash-decoding splits), and the visible logical slot range of each request.
struct DecodePlan {
  std::vector<int64_t> lo, hi;  // [batch] visible slots [lo, hi)
  std::vector<skv::DecodeItem> items;
  std::vector<int64_t> first_item;  // [batch * kvh + 1] items of (b, h) start here
  std::vector<int64_t> order;       // item indices, longest first
  int64_t total_pages = 0;          // held pages visited, over requests
};

DecodePlan plan_decode(const skv::DecodeArgs& a, int64_t batch, const int64_t* seq_lens,
                       const int64_t* first_slots, int64_t num_pages, int64_t sliding_window) {
  const int64_t bs = a.block_size, kvh = a.num_kv_heads;
  DecodePlan plan;
  plan.lo.resize(batch);
  plan.hi.resize(batch);
  std::vector<int64_t> p0(batch), p1(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t fs = first_slots[b], sl = seq_lens[b];
    TORCH_CHECK(fs >= 0 && fs % bs == 0, "first_slot must be a multiple of block_size");
    TORCH_CHECK(sl <= fs + a.held_cap, "seq_len exceeds the block table");
    plan.hi[b] = sl;
    plan.lo[b] = sliding_window > 0 ? std::max(fs, sl - sliding_window) : fs;
    p0[b] = p1[b] = 0;
    if (plan.hi[b] > plan.lo[b]) {
      p0[b] = (plan.lo[b] - fs) / bs;
      p1[b] = (plan.hi[b] - 1 - fs) / bs + 1;
    }
    for (int64_t p = p0[b]; p < p1[b]; ++p) {
      const int64_t page = a.block_tables[b * a.max_blocks + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "block table entry out of range: ", page);
    }
    plan.total_pages += p1[b] - p0[b];
  }
  const int64_t target_items = std::max<int64_t>(4 * at::get_num_threads(), 1);
  const int64_t min_pages = std::max<int64_t>(1, 256 / bs);
  const int64_t chunk_pages =
      std::max(min_pages, (plan.total_pages * kvh + target_items - 1) / target_items);
  plan.first_item.assign(batch * kvh + 1, 0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kvh; ++h) {
      plan.first_item[b * kvh + h] = (int64_t)plan.items.size();
      for (int64_t p = p0[b]; p < p1[b]; p += chunk_pages)
        plan.items.push_back({b, h, p, std::min(p + chunk_pages, p1[b]), plan.lo[b], plan.hi[b],
                              first_slots[b]});
    }
  plan.first_item[batch * kvh] = (int64_t)plan.items.size();
  const auto& items = plan.items;
  plan.order.resize(items.size());
  for (size_t i = 0; i < items.size(); ++i) plan.order[i] = (int64_t)i;
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](int64_t x, int64_t y) {
    return items[x].page_end - items[x].page_begin > items[y].page_end - items[y].page_begin;
  });
  return plan;
}

// Scales of a checked quantized pool: per slot for int8 / fp8 (kv_scales), the four fp16
// tensors of int4 pools (key scale, key zero, value scale, value zero); undefined otherwise.
struct PoolScales {
  at::Tensor kv_scales;
  at::Tensor int4[4];
};

// Decode over a checked pool of element type kv_type. Returns [out, lse, mass] (mass is an
// empty tensor unless return_mass).
std::vector<at::Tensor> run_decode(const skv::KernelTable& table, const at::Tensor& query_in,
                                   const at::Tensor& pool, const PoolScales& scales,
                                   skv::KvType kv_type, const at::Tensor& block_tables_in,
                                   const at::Tensor& seq_lens_in,
                                   const at::Tensor& first_slots_in, double scale,
                                   int64_t sliding_window, double softcap, bool return_mass) {
  TORCH_CHECK(query_in.dim() == 3, "query must be [batch, num_heads, head_dim]");
  const int64_t batch = query_in.size(0), num_heads = query_in.size(1), d = query_in.size(2);
  const int64_t kvh = pool.size(2), bs = pool.size(3);
  const int64_t pool_d = kv_type == skv::kKvInt4 ? 2 * pool.size(4) : pool.size(4);
  TORCH_CHECK(pool_d == d, "head_dim of query (", d, ") and the pool (", pool_d, ") differ");
  TORCH_CHECK(num_heads % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(d % (2 * table.width) == 0, "head_dim must be a multiple of ", 2 * table.width);
  auto query = query_in.contiguous();
  auto block_tables = block_tables_in.to(at::kLong).contiguous();
  auto seq_lens = seq_lens_in.to(at::kLong).contiguous();
  auto first_slots = first_slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch, "block_tables shape");
  TORCH_CHECK(seq_lens.numel() == batch && first_slots.numel() == batch, "seq_lens shape");
  const int64_t max_blocks = block_tables.size(1), group = num_heads / kvh;
  const int64_t held_cap = max_blocks * bs;

  auto out = at::empty_like(query);
  auto lse = at::empty({batch, num_heads}, query.options().dtype(at::kFloat));
  at::Tensor mass = at::empty({0}, lse.options()), scores;
  if (return_mass) {
    mass = at::zeros({batch, kvh, held_cap}, lse.options());
    scores = at::empty({batch, kvh, group, held_cap}, lse.options());
  }

  skv::DecodeArgs args{};
  args.query = query.data_ptr();
  args.pool = pool.data_ptr();
  args.kv_scales = scales.kv_scales.defined() ? scales.kv_scales.data_ptr<float>() : nullptr;
  const uint16_t* int4[4] = {};
  for (int i = 0; i < 4; ++i)
    if (scales.int4[i].defined())
      int4[i] = reinterpret_cast<const uint16_t*>(scales.int4[i].data_ptr<at::Half>());
  args.key_scale = int4[0];
  args.key_zero = int4[1];
  args.value_scale = int4[2];
  args.value_zero = int4[3];
  args.block_tables = block_tables.data_ptr<int64_t>();
  args.max_blocks = max_blocks;
  args.num_heads = num_heads;
  args.num_kv_heads = kvh;
  args.block_size = bs;
  args.head_dim = d;
  args.scale = (float)scale;
  args.softcap = softcap > 0 ? (float)softcap : 0.0f;
  args.kv_type = kv_type;
  args.query_bf16 = query.scalar_type() == at::kBFloat16;
  args.out = out.data_ptr();
  args.lse = lse.data_ptr<float>();
  args.scores = return_mass ? scores.data_ptr<float>() : nullptr;
  args.mass = return_mass ? mass.data_ptr<float>() : nullptr;
  args.held_cap = held_cap;
  const DecodePlan plan = plan_decode(args, batch, seq_lens.data_ptr<int64_t>(),
                                      first_slots.data_ptr<int64_t>(), pool.size(0),
                                      sliding_window);

  const int64_t state_floats = skv::decode_state_floats(group, d);
  std::vector<float> states(plan.items.size() * state_floats);
  const int64_t scratch = std::max(table.decode_scratch(args), d);
  const int64_t* fs = first_slots.data_ptr<int64_t>();
  const auto combine = [&](int64_t i, float* buf) {  // i: (request, KV head)
    const int64_t b = i / kvh, h = i % kvh, lo = plan.lo[b], hi = plan.hi[b];
    const int64_t n = plan.first_item[i + 1] - plan.first_item[i];
    table.decode_combine(args, b, h, states.data() + plan.first_item[i] * state_floats, n,
                         lo - fs[b], std::max(hi, lo) - fs[b], buf);
  };
  // Splits of a (request, KV head) still running: the thread that finishes the last one merges
  // them in the same parallel region. A second region for the merge costs a wake-up and a
  // barrier per call, and far more when other processes hold a core (one decode step, 30
  // layers, batch 16 x 2000 slots, 2 threads, a third busy process: ~240 ms here against
  // ~470 ms with a second region).
  std::vector<std::atomic<int64_t>> pending(batch * kvh);
  std::vector<float> idle_buf;  // (request, KV head) pairs without items: nothing visible
  for (int64_t i = 0; i < batch * kvh; ++i) {
    const int64_t n = plan.first_item[i + 1] - plan.first_item[i];
    pending[i].store(n, std::memory_order_relaxed);
    if (n == 0) {
      if (idle_buf.empty()) idle_buf.resize(scratch + 64);
      combine(i, idle_buf.data());
    }
  }
  const int64_t work = plan.total_pages * bs * kvh * group * d * 2;
  run_dynamic((int64_t)plan.items.size(), work, scratch, [&](int64_t i, float* buf) {
    const int64_t k = plan.order[i];
    const skv::DecodeItem& it = plan.items[k];
    table.decode_item(args, it, buf, states.data() + k * state_floats);
    // acq_rel: the other splits' states (and scores) are visible to the thread that merges.
    const int64_t pair = it.b * kvh + it.kvh;
    if (pending[pair].fetch_sub(1, std::memory_order_acq_rel) == 1) combine(pair, buf);
  });
  return {out, lse, mass};
}

// Returns [out, lse, mass] (mass is an empty tensor unless return_mass).
std::vector<at::Tensor> paged_decode(const at::Tensor& query, const at::Tensor& pool,
                                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                     const at::Tensor& first_slots, double scale,
                                     int64_t sliding_window, double softcap, bool return_mass,
                                     c10::string_view isa) {
  check_pool(pool);
  const auto& table = table_for(isa);
  TORCH_CHECK(query.scalar_type() == pool.scalar_type(), "query and kv_pool dtypes differ");
  const auto kv_type = pool.scalar_type() == at::kBFloat16 ? skv::kKvBFloat16 : skv::kKvFloat32;
  return run_decode(table, query, pool, PoolScales(), kv_type, block_tables, seq_lens,
                    first_slots, scale, sliding_window, softcap, return_mass);
}

void check_query(const at::Tensor& query) {  // of the quantized pools: fp32 or bf16
  TORCH_CHECK(query.device().is_cpu(), "query must be on CPU");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "query must be float32 or bfloat16, got ", query.scalar_type());
}

// paged_decode over int8 / fp8 codes with per-slot scales; query and out fp32 or bf16.
std::vector<at::Tensor> paged_decode_quantized(
    const at::Tensor& query, const at::Tensor& kv_data, const at::Tensor& kv_scales,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& first_slots,
    double scale, int64_t sliding_window, double softcap, bool return_mass,
    c10::string_view isa) {
  const skv::KvType kv_type = check_quantized_pool(kv_data, kv_scales);
  const auto& table = table_for(isa);
  // Codes are read 4 per 32-bit lane, a quad of 4 * width per load (vec_impl.h).
  TORCH_CHECK(kv_data.size(4) % (4 * table.width) == 0, "head_dim of int8 / fp8 pools must be a ",
              "multiple of ", 4 * table.width, " for kernel variant '", std::string(isa), "'");
  check_query(query);
  PoolScales scales;
  scales.kv_scales = kv_scales;
  return run_decode(table, query, kv_data, scales, kv_type, block_tables, seq_lens, first_slots,
                    scale, sliding_window, softcap, return_mass);
}

// paged_decode over KIVI int4 pages; query and out fp32 or bf16.
std::vector<at::Tensor> paged_decode_int4(
    const at::Tensor& query, const at::Tensor& codes, const at::Tensor& key_scale,
    const at::Tensor& key_zero, const at::Tensor& value_scale, const at::Tensor& value_zero,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& first_slots,
    double scale, int64_t sliding_window, double softcap, bool return_mass,
    c10::string_view isa) {
  check_int4_pool(codes, key_scale, key_zero, value_scale, value_zero);
  const auto& table = table_for(isa);
  check_query(query);
  PoolScales scales;
  const at::Tensor* params[4] = {&key_scale, &key_zero, &value_scale, &value_zero};
  for (int i = 0; i < 4; ++i) scales.int4[i] = *params[i];
  return run_decode(table, query, codes, scales, skv::kKvInt4, block_tables, seq_lens,
                    first_slots, scale, sliding_window, softcap, return_mass);
}

at::Tensor window_scores(const at::Tensor& window_queries, const at::Tensor& lse,
                         const at::Tensor& pool, const at::Tensor& block_table_in,
                         int64_t num_slots, double scale, c10::string_view isa) {
  check_pool(pool);
  const auto& table = table_for(isa);
  TORCH_CHECK(window_queries.dim() == 3, "window_queries must be [num_heads, window, head_dim]");
  const int64_t num_heads = window_queries.size(0), w = window_queries.size(1);
  const int64_t d = window_queries.size(2), kvh = pool.size(2), bs = pool.size(3);
  TORCH_CHECK(pool.size(4) == d, "head_dim of window_queries and kv_pool differ");
  TORCH_CHECK(num_heads % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == num_heads && lse.size(1) == w, "lse shape");
  auto block_table = block_table_in.to(at::kLong).contiguous();
  const int64_t num_blocks = (num_slots + bs - 1) / bs;
  TORCH_CHECK(num_slots >= 0 && block_table.numel() >= num_blocks, "block_table too short");
  const int64_t* bt = block_table.data_ptr<int64_t>();
  for (int64_t p = 0; p < num_blocks; ++p)
    TORCH_CHECK(bt[p] >= 0 && bt[p] < pool.size(0), "block table entry out of range: ", bt[p]);
  auto out = at::zeros({num_heads, num_slots}, pool.options().dtype(at::kFloat));
  if (num_slots == 0 || w == 0 || num_heads == 0) return out;

  // Rows: each head's window rows padded to the vector width, all padded to the row block.
  const int64_t group = num_heads / kvh, W = table.width;
  const int64_t wp = (w + W - 1) / W * W;
  const int64_t row_block = table.window_row_block * W;
  const int64_t rows = (group * wp + row_block - 1) / row_block * row_block;
  auto fopt = out.options();
  auto q = at::zeros({kvh, rows, d}, fopt);
  auto l = at::zeros({kvh, rows}, fopt);
  auto thr = at::full({rows}, -1.0, fopt);
  auto qv = window_queries.to(at::kFloat).mul(scale).view({kvh, group, w, d});
  auto lv = lse.to(at::kFloat).view({kvh, group, w});
  auto steps = at::arange(w, fopt).add_(double(num_slots - w));
  for (int64_t g = 0; g < group; ++g) {
    q.narrow(1, g * wp, w).copy_(qv.select(1, g));
    l.narrow(1, g * wp, w).copy_(lv.select(1, g));
    thr.narrow(0, g * wp, w).copy_(steps);
  }
  auto qt = q.transpose(1, 2).contiguous();  // [kvh, d, rows]
  at::Tensor qpairs;
  if (table.window_bf16_pairs && pool.scalar_type() == at::kBFloat16 &&
      window_queries.scalar_type() == at::kBFloat16) {
    // Unscaled bf16 rows laid out as qt, read as words of two elements and cut into AMX
    // tiles: [kvh, rows / 16, d / 32, 16 pairs, 16 rows].
    auto qb = at::zeros({kvh, rows, d}, window_queries.options());
    auto src = window_queries.contiguous().view({kvh, group, w, d});
    for (int64_t g = 0; g < group; ++g) qb.narrow(1, g * wp, w).copy_(src.select(1, g));
    qpairs = qb.view(at::kInt).view({kvh, rows / 16, 16, d / 32, 16}).permute({0, 1, 3, 4, 2});
    qpairs = qpairs.contiguous();
  }

  skv::WindowArgs args{};
  args.qt = qt.data_ptr<float>();
  args.lse = l.data_ptr<float>();
  args.thr = thr.data_ptr<float>();
  args.pool = pool.data_ptr();
  args.block_table = bt;
  args.num_kv_heads = kvh;
  args.block_size = bs;
  args.head_dim = d;
  args.num_slots = num_slots;
  args.group = group;
  args.rows_per_head = wp;
  args.rows = rows;
  args.is_bf16 = pool.scalar_type() == at::kBFloat16;
  args.out = out.data_ptr<float>();
  args.qpairs = qpairs.defined() ? reinterpret_cast<const uint32_t*>(qpairs.data_ptr()) : nullptr;
  args.scale = (float)scale;
  // Items of a few pages of one KV head: fewer calls (the AMX kernel configures its tiles
  // once per call), still ~8 items per thread to balance.
  const int64_t work = num_slots * kvh * rows * d;
  const int64_t per_item =
      std::clamp<int64_t>(num_blocks * kvh / (8 * at::get_num_threads()), 1, kWindowMaxPages);
  const int64_t items_per_head = (num_blocks + per_item - 1) / per_item;
  run_dynamic(kvh * items_per_head, work, table.window_scratch(args), [&](int64_t i, float* buf) {
    const int64_t p0 = i / kvh * per_item;
    table.window_pages(args, i % kvh, p0, std::min(p0 + per_item, num_blocks), buf);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(sparsekv_cpu, m) {
  m.def("available_isas", &available_isas);
  m.def("amx_status", &skv::amx_status);
  m.def("vector_width", &vector_width);
  m.def("paged_decode", &paged_decode);
  m.def("paged_decode_quantized", &paged_decode_quantized);
  m.def("paged_decode_int4", &paged_decode_int4);
  m.def("window_scores", &window_scores);
}
