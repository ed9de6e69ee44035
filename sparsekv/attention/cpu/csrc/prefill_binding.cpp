// Torch operators of the causal prefill attention kernels (prefill.h):
//   prefill_isas()                                   variants this CPU runs, fastest first
//   prefill_isa_status(isa)                          "ok" or why the CPU does not run it
//   prefill_qk_int8_status()                         "ok" or why int8 Q·K^T cannot run here
//   prefill_attention(query, key, value, scale, window, isa, qk_int8) -> [out, lse]
//                                                    bf16, or fp32 on the fp32 variants;
//                                                    qk_int8: Q·K^T in int8 (prefill_qk8.h,
//                                                    avx512_bf16 only)
// and the CPU feature list of `sparsekv bench kernels --list`. Registered as a fragment of the
// sparsekv_cpu library (binding.cpp holds the rest).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <vector>

#include "isa_select.h"
#include "prefill.h"
#include "run_items.h"

namespace skv = sparsekv_cpu;
using skv::run_dynamic;

namespace {

#include "prefill_pack.h"



struct PrefillVariant {
  const char* name;
  const skv::PrefillKernel* kernel;
  Packing packing;
};

const PrefillVariant kPrefillVariants[] = {  // fastest first
    {"avx512_amx", &skv::kPrefillAmx, Packing::kAmxTiles},
    {"avx512_bf16", &skv::kPrefillBf16, Packing::kBf16Pairs},
    {"avx512", &skv::kPrefillAvx512, Packing::kFloat32},
    {"avx2", &skv::kPrefillAvx2, Packing::kFloat32},
    {"generic", &skv::kPrefillGeneric, Packing::kFloat32},
};

std::string variant_status(const PrefillVariant& v) {
  if (v.kernel->item == nullptr) return "not compiled (needs GCC 11 or newer)";
  if (v.packing == Packing::kAmxTiles) return skv::amx_status();
  if (v.packing == Packing::kBf16Pairs) return skv::avx512_bf16_status();
  // The fp32 kernels live in the units of the decode variants of the same name.
  return skv::find_table(v.name) != nullptr ? "ok" : std::string("no ") + v.name + " on this CPU";
}

std::string prefill_isa_status(c10::string_view isa) {
  for (const auto& v : kPrefillVariants)
    if (isa == v.name) return variant_status(v);
  return "no prefill kernel variant '" + std::string(isa) + "'";
}

std::string prefill_isas() {  // comma-separated, fastest first
  std::string out;
  for (const auto& v : kPrefillVariants)
    if (variant_status(v) == "ok") out += (out.empty() ? "" : ",") + std::string(v.name);
  return out;
}

std::string prefill_qk_int8_status() {
  if (skv::kPrefillBf16Qk8.item == nullptr) return "not compiled (needs GCC 11 or newer)";
  return skv::avx512_vnni_status();
}

bool prefill_available() { return variant_status(kPrefillVariants[0]) == "ok"; }

std::string cpu_features() {
  std::string out;
  for (const auto& f : skv::cpu_features()) out += (out.empty() ? "" : ",") + f;
  return out;
}

// Query rows per head of one prefill work item: about 64 columns (group x rows) per item,
// enough to amortise each K/V load over the group, small enough for L1 (prefill_amx.h).
int64_t prefill_query_block(int64_t group) {
  return group >= 3 ? 16 : group == 2 ? 32 : 64;
}

void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  int64_t window) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "query, key and value must be 3-D [heads, positions, head_dim]");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "query, key and value must be on CPU");
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && key.scalar_type() == dtype &&
                  value.scalar_type() == dtype,
              "query, key and value must be all bfloat16 or all float32");
  TORCH_CHECK(key.sizes() == value.sizes(), "key and value shapes differ: ", key.sizes(), " vs ",
              value.sizes());
  const int64_t H = query.size(0), nq = query.size(1), d = query.size(2);
  const int64_t kvh = key.size(0), nk = key.size(1);
  TORCH_CHECK(key.size(2) == d, "head_dim of query (", d, ") and key (", key.size(2), ") differ");
  TORCH_CHECK(d > 0 && d % 32 == 0, "head_dim must be a multiple of 32, got ", d);
  TORCH_CHECK(kvh > 0 && H % kvh == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(nq <= nk, "more queries (", nq, ") than keys (", nk, ")");
  TORCH_CHECK(nk < (int64_t(1) << 30), "too many keys");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  const int64_t group = H / kvh;
  TORCH_CHECK(group * prefill_query_block(group) <= 1024,
              "GQA group too large for the prefill kernel: ", group);
}

// Causal attention of the last nq of nk positions (prefill.h) on kernel variant `isa`; bf16
// (any variant) or fp32 (the fp32 variants) query [num_heads, nq, head_dim], key / value
// [num_kv_heads, nk, head_dim]; window > 0: each row sees only its `window` most recent keys
// (itself included); qk_int8: the logits in int8 (avx512_bf16, head_dim <= 256). Returns
// [out (the inputs' dtype), lse].
std::vector<at::Tensor> prefill_attention(const at::Tensor& query_in, const at::Tensor& key,
                                          const at::Tensor& value, double scale, int64_t window,
                                          c10::string_view isa, bool qk_int8) {
  const PrefillVariant* variant = nullptr;
  for (const auto& v : kPrefillVariants)
    if (isa == v.name) variant = &v;
  TORCH_CHECK(variant != nullptr, "no prefill kernel variant '", std::string(isa), "'");
  const std::string status = variant_status(*variant);
  TORCH_CHECK(status == "ok", "the ", variant->name, " prefill kernel is unavailable: ", status);
  check_inputs(query_in, key, value, window);
  const bool f32_in = query_in.scalar_type() == at::kFloat;
  TORCH_CHECK(!f32_in || variant->packing == Packing::kFloat32, "the ", variant->name,
              " prefill kernel takes bfloat16 only; float32 runs on avx512, avx2 or generic");
  if (qk_int8) {
    TORCH_CHECK(variant->packing == Packing::kBf16Pairs,
                "int8 Q·K^T runs on the avx512_bf16 prefill kernel only, not ", variant->name);
    const std::string qk_status = prefill_qk_int8_status();
    TORCH_CHECK(qk_status == "ok", "int8 Q·K^T is unavailable: ", qk_status);
    TORCH_CHECK(query_in.size(2) <= 256, "int8 Q·K^T takes head_dim <= 256, got ",
                query_in.size(2));
  }
  const int64_t H = query_in.size(0), nq = query_in.size(1), d = query_in.size(2);
  const int64_t kvh = key.size(0), nk = key.size(1);
  // Rows are read with their strides: the model's queries are a transposed view.
  auto query = query_in.stride(2) == 1 ? query_in : query_in.contiguous();
  auto out = at::empty({H, nq, d}, query.options());
  auto lse = at::empty({H, nq}, query.options().dtype(at::kFloat));
  if (nq == 0 || H == 0) return {out, lse};

  skv::PrefillArgs args{};
  const auto packed = pack_keys(variant->packing, key, value, qk_int8, args);
  if (f32_in) {
    args.query_f32 = query.data_ptr<float>();
    args.out_f32 = out.data_ptr<float>();
  } else {
    args.query = reinterpret_cast<const uint16_t*>(query.data_ptr());
    args.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  }
  args.query_head_stride = query.stride(0);
  args.query_row_stride = query.stride(1);
  args.num_heads = H;
  args.num_kv_heads = kvh;
  args.nq = nq;
  args.nk = nk;
  args.head_dim = d;
  args.query_block = prefill_query_block(H / kvh);
  args.scale = (float)scale;
  args.window = window < nk ? window : 0;  // a window of every key is no window
  args.lse = lse.data_ptr<float>();
  // Items: (KV head, query block), KV head by KV head so that the threads share one head's
  // K and V in cache (interleaving the heads thrashed L2: 45 -> 39 ms on one thread at 4k
  // tokens), the last query blocks (most keys) first so that the short ones balance the end.
  const int64_t block = args.query_block, num_blocks = (nq + block - 1) / block;
  const int64_t span = args.window > 0 && args.window < nk - nq / 2 ? args.window : nk - nq / 2;
  const int64_t work = H * nq * span * d * 2;
  const skv::PrefillKernel& kernel = *variant->kernel;
  const auto item = qk_int8 ? skv::kPrefillBf16Qk8.item : kernel.item;
  const int64_t scratch = qk_int8 ? skv::kPrefillBf16Qk8.scratch(args) : kernel.scratch(args);
  run_dynamic(num_blocks * kvh, work, scratch, [&](int64_t i, float* buf) {
    item(args, i / num_blocks, num_blocks - 1 - i % num_blocks, buf);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparsekv_cpu, m) {
  m.def("prefill_available", &prefill_available);
  m.def("prefill_isas", &prefill_isas);
  m.def("prefill_isa_status", &prefill_isa_status);
  m.def("prefill_qk_int8_status", &prefill_qk_int8_status);
  m.def("cpu_features", &cpu_features);
  m.def("prefill_attention", &prefill_attention);
}
