// Torch operators of the fused window-score kernel (window_fused.h):
//   window_scores_fused(queries, keys, lse?, scale, isa)                   dense keys
//   window_scores_fused_paged(queries, pool, tables, num_slots, lse?, scale, isa)  in pages
//   window_fused_isas()   the variants this CPU runs (avx512_amx, avx512_bf16, avx2, generic),
//                         fastest first
// Both return [scores [num_heads, n] fp32, lse [num_heads, w] fp32]. Queries and keys are bf16
// on every variant, or fp32 on the fp32-FMA ones (avx2, generic). Registered as a fragment of
// the sparsekv_cpu library (binding.cpp holds the rest).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "isa_select.h"
#include "window_fused.h"

namespace skv = sparsekv_cpu;

namespace {

// Variants, fastest first: AMX tiles, AVX512-BF16 dot products, fp32 FMAs on AVX2, portable.
struct Variant {
  const char* name;
  const skv::WindowFusedKernel* kernel;
};
const Variant kVariants[] = {{"avx512_amx", &skv::kWindowFusedAmx},
                             {"avx512_bf16", &skv::kWindowFusedBf16},
                             {"avx2", &skv::kWindowFusedAvx2},
                             {"generic", &skv::kWindowFusedGeneric}};

// "ok" when this CPU runs variant v, else why not.
std::string variant_status(const Variant& v) {
  if (v.kernel->item == nullptr) return "not compiled (needs a newer GCC)";
  const std::string name = v.name;
  if (name == "avx512_amx") return skv::amx_status();
  if (name == "avx512_bf16") return skv::avx512_bf16_status();
  if (name == "avx2") return skv::find_table("avx2") != nullptr ? "ok" : "no AVX2 / FMA";
  return "ok";
}

std::string window_fused_isas() {  // comma-separated, fastest first
  std::string out;
  for (const Variant& v : kVariants)
    if (variant_status(v) == "ok") out += std::string(out.empty() ? "" : ",") + v.name;
  return out;
}

// The kernel of variant `isa` for queries of `dtype` (fp32: the FMA variants only).
const skv::WindowFusedKernel& kernel_for(c10::string_view isa, at::ScalarType dtype) {
  for (const Variant& v : kVariants) {
    if (isa != v.name) continue;
    const std::string status = variant_status(v);
    TORCH_CHECK(status == "ok", "the ", std::string(isa), " window kernel is unavailable: ",
                status);
    TORCH_CHECK(dtype != at::kFloat || v.kernel == &skv::kWindowFusedAvx2 ||
                    v.kernel == &skv::kWindowFusedGeneric,
                "the ", std::string(isa),
                " window kernel takes bfloat16 only; float32 runs on avx2 or generic");
    return *v.kernel;
  }
  TORCH_CHECK(false, "no fused window kernel variant '", std::string(isa), "'");
}

void check_queries(const at::Tensor& queries, const std::optional<at::Tensor>& lse) {
  TORCH_CHECK(queries.dim() == 3, "queries must be [num_heads, window, head_dim]");
  TORCH_CHECK(queries.device().is_cpu() && (queries.scalar_type() == at::kBFloat16 ||
                                            queries.scalar_type() == at::kFloat),
              "queries must be bfloat16 or float32 on CPU");
  TORCH_CHECK(queries.size(2) > 0 && queries.size(2) % 32 == 0,
              "head_dim must be a multiple of 32, got ", queries.size(2));
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->is_contiguous() &&
                    lse->sizes() == at::IntArrayRef({queries.size(0), queries.size(1)}),
                "lse must be contiguous float32 [num_heads, window]");
  }
}

// Pointers to key blocks at element offsets of a bf16 or fp32 tensor, as WindowFusedArgs takes
// them (key_blocks or key_blocks_f32).
class KeyBlocks {
 public:
  KeyBlocks(const at::Tensor& t, const std::vector<int64_t>& offsets) {
    if (t.scalar_type() == at::kFloat) {
      for (int64_t o : offsets) f32_.push_back(t.data_ptr<float>() + o);
    } else {
      const auto* base = reinterpret_cast<const uint16_t*>(t.data_ptr());
      for (int64_t o : offsets) bf16_.push_back(base + o);
    }
  }
  void point(skv::WindowFusedArgs& a) const {
    a.key_blocks = bf16_.empty() ? nullptr : bf16_.data();
    a.key_blocks_f32 = f32_.empty() ? nullptr : f32_.data();
  }

 private:
  std::vector<const uint16_t*> bf16_;
  std::vector<const float*> f32_;
};

// Fills the shape fields, runs one item per KV head on the intra-op threads.
std::vector<at::Tensor> run(const skv::WindowFusedKernel& kernel, skv::WindowFusedArgs& a,
                            const at::Tensor& queries, const std::optional<at::Tensor>& lse,
                            int64_t num_kv_heads, int64_t n, double scale) {
  const int64_t num_heads = queries.size(0), w = queries.size(1), d = queries.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "num_heads must be a multiple of the KV heads");
  TORCH_CHECK(w >= 1 && w <= n, "need 1 <= window <= num_slots, got ", w, " and ", n);
  auto q = queries.stride(2) == 1 ? queries : queries.contiguous();
  auto out = at::empty({num_heads, n}, queries.options().dtype(at::kFloat));
  auto lse_out = at::empty({num_heads, w}, queries.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kFloat)
    a.query_f32 = q.data_ptr<float>();
  else
    a.query = reinterpret_cast<const uint16_t*>(q.data_ptr());
  a.query_head_stride = q.stride(0);
  a.query_row_stride = q.stride(1);
  a.lse_in = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  a.num_kv_heads = num_kv_heads;
  a.group = num_heads / num_kv_heads;
  a.w = w;
  a.n = n;
  a.num_blocks = (n + 15) / 16;
  a.head_dim = d;
  a.rows = (a.group * w + 15) / 16 * 16;
  a.scale = (float)scale;
  a.out = out.data_ptr<float>();
  a.lse_out = lse_out.data_ptr<float>();
  const int64_t scratch = kernel.scratch(a);
  // Below ~0.1 ms of work one thread is faster than waking the pool.
  const int64_t work = num_kv_heads * a.rows * n * d;
  const int64_t threads =
      work < (int64_t(1) << 21) ? 1 : std::min<int64_t>(at::get_num_threads(), num_kv_heads);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(scratch + 64);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t k = next.fetch_add(1); k < num_kv_heads; k = next.fetch_add(1))
        kernel.item(a, k, buf.data());
  });
  return {out, lse_out};
}

std::vector<at::Tensor> window_scores_fused(const at::Tensor& queries, const at::Tensor& keys,
                                            const std::optional<at::Tensor>& lse, double scale,
                                            c10::string_view isa) {
  const skv::WindowFusedKernel& kernel = kernel_for(isa, queries.scalar_type());
  check_queries(queries, lse);
  TORCH_CHECK(keys.dim() == 3 && keys.device().is_cpu() &&
                  keys.scalar_type() == queries.scalar_type(),
              "keys must be [num_kv_heads, n, head_dim] on CPU, of the queries' dtype");
  TORCH_CHECK(keys.size(2) == queries.size(2), "head_dim of queries and keys differ");
  auto k = keys.stride(2) == 1 ? keys : keys.contiguous();
  const int64_t kvh = k.size(0), n = k.size(1), blocks = (n + 15) / 16;
  // Block starts as element offsets; the element type is the keys'.
  std::vector<int64_t> offsets(kvh * blocks);
  for (int64_t h = 0; h < kvh; ++h)
    for (int64_t b = 0; b < blocks; ++b)
      offsets[h * blocks + b] = h * k.stride(0) + b * 16 * k.stride(1);
  KeyBlocks blocks_of(k, offsets);
  skv::WindowFusedArgs a{};
  blocks_of.point(a);
  a.key_row_stride = k.stride(1);
  return run(kernel, a, queries, lse, kvh, n, scale);
}

std::vector<at::Tensor> window_scores_fused_paged(const at::Tensor& queries,
                                                  const at::Tensor& pool,
                                                  const at::Tensor& tables, int64_t num_slots,
                                                  const std::optional<at::Tensor>& lse,
                                                  double scale, c10::string_view isa) {
  const skv::WindowFusedKernel& kernel = kernel_for(isa, queries.scalar_type());
  check_queries(queries, lse);
  TORCH_CHECK(pool.dim() == 5 && pool.size(1) == 2 && pool.is_contiguous() &&
                  pool.device().is_cpu() && pool.scalar_type() == queries.scalar_type(),
              "kv_pool must be contiguous [num_pages, 2, num_kv_heads, block, head_dim] of the "
              "queries' dtype");
  TORCH_CHECK(pool.size(4) == queries.size(2), "head_dim of queries and kv_pool differ");
  const int64_t kvh = pool.size(2), bs = pool.size(3), d = pool.size(4);
  TORCH_CHECK(bs % 16 == 0, "block_size must be a multiple of 16, got ", bs);
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(),
              "tables must be contiguous int64 [layers, num_blocks]");
  const int64_t layers = tables.size(0), blocks = (num_slots + 15) / 16;
  TORCH_CHECK(tables.size(1) * bs >= num_slots, "tables cover fewer than num_slots slots");
  const int64_t* table = tables.data_ptr<int64_t>();
  std::vector<int64_t> offsets(layers * kvh * blocks);
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t page = table[l * tables.size(1) + b * 16 / bs];
      TORCH_CHECK(page >= 0 && page < pool.size(0), "page id ", page, " out of range");
      for (int64_t h = 0; h < kvh; ++h)
        offsets[(l * kvh + h) * blocks + b] = ((page * 2) * kvh + h) * bs * d + (b * 16 % bs) * d;
    }
  KeyBlocks blocks_of(pool, offsets);
  skv::WindowFusedArgs a{};
  blocks_of.point(a);
  a.key_row_stride = d;
  return run(kernel, a, queries, lse, layers * kvh, num_slots, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparsekv_cpu, m) {
  m.def("window_fused_isas", &window_fused_isas);
  m.def("window_scores_fused", &window_scores_fused);
  m.def("window_scores_fused_paged", &window_scores_fused_paged);
}
