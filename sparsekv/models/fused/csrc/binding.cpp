// Torch operators of the fused elementwise kernels (torch.ops.sparsekv_fused.*): argument
// checks, row layouts, threading, and the run-time choice of the ISA variant. Compiled for the
// baseline ISA; registered with TORCH_LIBRARY and light ATen headers (torch/extension.h alone
// costs ~45 s of compile time).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fused.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace fk = sparsekv_fused;

namespace {

bool has_avx512() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

bool has_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool always() { return true; }

bool has_avx512_bf16() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return fk::kGemvAvx512Bf16Compiled && has_avx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

struct Variant {
  const char* name;
  const fk::FusedTable* table;
  bool (*cpu_runs)();
};

const Variant kVariants[] = {  // fastest first
    {"avx512", &fk::kTableAvx512, has_avx512},
    {"avx2", &fk::kTableAvx2, has_avx2},
    {"generic", &fk::kTableGeneric, always},
};

bool usable(const Variant& v) { return v.table->width > 0 && v.cpu_runs(); }

std::string available_isas() {  // comma-separated, fastest first
  std::string out;
  for (const auto& v : kVariants)
    if (usable(v)) out += (out.empty() ? "" : ",") + std::string(v.name);
  return out;
}

// `isa` empty: the fastest variant this CPU runs.
const fk::FusedTable& table_for(c10::string_view isa) {
  static const fk::FusedTable* fastest = [] {
    for (const auto& v : kVariants)
      if (usable(v)) return v.table;
    return &fk::kTableGeneric;
  }();
  if (isa.empty()) return *fastest;
  for (const auto& v : kVariants)
    if (isa == v.name && usable(v)) return *v.table;
  TORCH_CHECK(false, "fused-op variant '", std::string(isa), "' is not supported on this CPU");
}

// Below this many elements per task a call stays on the calling thread: waking the pool costs
// more (decode-sized calls), and far more while other processes keep the cores busy.
constexpr int64_t kMinTaskElements = 1 << 15;

template <typename F>
void for_rows(int64_t rows, int64_t row_elements, const F& fn) {
  if (rows == 0) return;
  const int64_t grain = std::max<int64_t>(1, kMinTaskElements / std::max<int64_t>(1, row_elements));
  at::parallel_for(0, rows, grain, fn);
}

void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1, name, " must have at least one dimension");
}

// x [..., n] as rows of n contiguous elements at two levels of strides (fused.h), if its
// leading dimensions collapse into at most two; else false.
bool row_layout(const at::Tensor& x, fk::RowLayout& layout) {
  if (x.size(-1) > 1 && x.stride(-1) != 1) return false;
  std::vector<std::pair<int64_t, int64_t>> groups;  // (size, stride), outermost first
  for (int64_t d = 0; d < x.dim() - 1; ++d) {
    if (x.size(d) == 1) continue;
    if (!groups.empty() && groups.back().second == x.stride(d) * x.size(d)) {
      groups.back() = {groups.back().first * x.size(d), x.stride(d)};
    } else {
      groups.emplace_back(x.size(d), x.stride(d));
    }
  }
  if (groups.size() > 2) return false;
  if (groups.size() == 2) {
    layout = {groups[1].first, groups[0].second, groups[1].second};
  } else {
    layout = {1, groups.empty() ? 0 : groups[0].second, 0};
  }
  return true;
}

// x itself when row_layout describes it, else a contiguous copy.
at::Tensor with_row_layout(const at::Tensor& x, fk::RowLayout& layout) {
  if (row_layout(x, layout)) return x;
  at::Tensor copy = x.contiguous();
  row_layout(copy, layout);
  return copy;
}

// The norm's scale as fp32: weight, or 1 + weight (Gemma), added in fp32 as eager does.
std::vector<float> norm_scale(const at::Tensor& weight, int64_t n, bool unit_offset) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "weight must be [", n, "], got ",
              weight.sizes());
  TORCH_CHECK(weight.device().is_cpu(), "weight must be on CPU");
  const at::Tensor w = weight.contiguous();
  std::vector<float> scale(n);
  if (w.scalar_type() == at::kFloat) {
    std::copy_n(w.const_data_ptr<float>(), n, scale.data());
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "weight must be float32 or bfloat16, got ",
                w.scalar_type());
    const c10::BFloat16* p = w.const_data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) scale[i] = static_cast<float>(p[i]);
  }
  if (unit_offset)
    for (auto& s : scale) s = 1.0f + s;
  return scale;
}

void run_norm(fk::NormArgs& args, const at::Tensor& x, const at::Tensor& weight, double eps,
              bool unit_offset, c10::string_view isa) {
  const auto& table = table_for(isa);
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  const std::vector<float> scale = norm_scale(weight, n, unit_offset);
  args.weight = scale.data();
  args.n = n;
  args.eps = static_cast<float>(eps);
  args.bf16 = x.scalar_type() == at::kBFloat16;
  for_rows(rows, n, [&](int64_t begin, int64_t end) { table.rms_norm(args, begin, end); });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset,
                    c10::string_view isa) {
  check_input(x, "x");
  fk::NormArgs args{};
  const at::Tensor input = with_row_layout(x, args.x_rows);
  at::Tensor out = at::empty(x.sizes(), x.options());
  args.x = input.const_data_ptr();
  args.out = out.mutable_data_ptr();
  run_norm(args, input, weight, eps, unit_offset, isa);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps,
                                                bool unit_offset, c10::string_view isa) {
  check_input(hidden, "hidden");
  TORCH_CHECK(delta.sizes() == hidden.sizes(), "delta must have hidden's shape ",
              hidden.sizes(), ", got ", delta.sizes());
  TORCH_CHECK(delta.scalar_type() == hidden.scalar_type() && delta.device().is_cpu(),
              "delta must be on CPU with hidden's dtype ", hidden.scalar_type());
  fk::NormArgs args{};
  const at::Tensor h = with_row_layout(hidden, args.x_rows);
  const at::Tensor d = with_row_layout(delta, args.delta_rows);
  at::Tensor sum = at::empty(hidden.sizes(), hidden.options());
  at::Tensor out = at::empty(hidden.sizes(), hidden.options());
  args.x = h.const_data_ptr();
  args.delta = d.const_data_ptr();
  args.sum_out = sum.mutable_data_ptr();
  args.out = out.mutable_data_ptr();
  run_norm(args, h, weight, eps, unit_offset, isa);
  return {sum, out};
}

using GluKernel = void (*)(const fk::GluArgs&, int64_t, int64_t);

// The bf16 activation table of `kernel` (GluArgs::lut) for the AVX-512 variant, built on first
// use by the kernel itself on every bf16 bit pattern (times up = 1, exact), so a lookup returns
// what the evaluation would; nullptr for the other variants (they do not use it).
const uint16_t* activation_lut(const fk::FusedTable& table, GluKernel kernel) {
  if (table.width != 16) return nullptr;
  static std::mutex mutex;
  static std::map<GluKernel, std::vector<uint16_t>> tables;
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<uint16_t>& lut = tables[kernel];
  if (lut.empty()) {
    constexpr int64_t kCodes = 1 << 16;
    std::vector<uint16_t> input(2 * kCodes, 0x3f80);  // gate: every pattern; up: 1.0
    for (int64_t i = 0; i < kCodes; ++i) input[i] = static_cast<uint16_t>(i);
    lut.assign(kCodes + 1, 0);
    const fk::GluArgs args{input.data(), kCodes, 2 * kCodes, true, lut.data(), nullptr};
    kernel(args, 0, 1);
  }
  return lut.data();
}

at::Tensor run_glu(const at::Tensor& x, const fk::FusedTable& table, GluKernel kernel) {
  check_input(x, "x");
  TORCH_CHECK(x.size(-1) % 2 == 0, "x's last dimension must be even (gate and up halves), got ",
              x.size(-1));
  fk::RowLayout layout{};
  at::Tensor input = x;
  if (!row_layout(x, layout) || layout.inner != 1) {
    input = x.contiguous();
    row_layout(input, layout);
  }
  const int64_t n = x.size(-1) / 2, rows = n == 0 ? 0 : x.numel() / (2 * n);
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const fk::GluArgs args{input.const_data_ptr(), n, layout.stride_outer, bf16,
                         out.mutable_data_ptr(), bf16 ? activation_lut(table, kernel) : nullptr};
  for_rows(rows, 2 * n, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  return out;
}

at::Tensor silu_mul(const at::Tensor& x, c10::string_view isa) {
  const auto& table = table_for(isa);
  return run_glu(x, table, table.silu_mul);
}

at::Tensor gelu_tanh_mul(const at::Tensor& x, c10::string_view isa) {
  const auto& table = table_for(isa);
  return run_glu(x, table, table.gelu_tanh_mul);
}

void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
             c10::string_view isa) {
  check_input(x, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [num_tokens, num_heads, head_dim], got ", x.sizes());
  const int64_t tokens = x.size(0), heads = x.size(1), head_dim = x.size(2);
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  TORCH_CHECK(x.stride(2) == 1 || head_dim <= 1,
              "x must be contiguous in its last dimension (rotated in place)");
  for (const auto* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == x.scalar_type() && table->device().is_cpu(),
                "cos and signed_sin must be on CPU with x's dtype ", x.scalar_type());
    TORCH_CHECK(table->numel() == tokens * head_dim,
                "cos and signed_sin must hold [num_tokens, head_dim] = [", tokens, ", ",
                head_dim, "] elements, got ", table->sizes());
  }
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  const fk::RotaryArgs args{x.data_ptr(), c.const_data_ptr(), s.const_data_ptr(), heads,
                            head_dim, x.stride(0), x.stride(1), head_dim,
                            x.scalar_type() == at::kBFloat16};
  const auto& table = table_for(isa);
  for_rows(tokens, heads * head_dim,
           [&](int64_t begin, int64_t end) { table.rotary(args, begin, end); });
}

// pool [num_pages, 2, num_kv_heads, block_size, head_dim] (contiguous) <- key, value
// [batch, num_kv_heads, head_dim] (same dtype, last dimension contiguous) at physical slots
// ``slots`` [batch] int64 (page * block_size + offset): torch_ref.write_kv without its index
// tensors (a decode step writes one slot per request and layer; the copies are raw bytes).
void write_kv_(const at::Tensor& pool, const at::Tensor& slots, const at::Tensor& key,
               const at::Tensor& value) {
  TORCH_CHECK(pool.device().is_cpu() && pool.dim() == 5 && pool.size(1) == 2 &&
                  pool.is_contiguous(),
              "pool must be a contiguous CPU [num_pages, 2, num_kv_heads, block_size, head_dim]");
  const int64_t pages = pool.size(0), heads = pool.size(2), block = pool.size(3),
                dim = pool.size(4);
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1,
              "slots must be a CPU int64 vector");
  const int64_t batch = slots.size(0);
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == pool.scalar_type(),
                "key and value must be on CPU with the pool's dtype ", pool.scalar_type());
    TORCH_CHECK(t->dim() == 3 && t->size(0) == batch && t->size(1) == heads &&
                    t->size(2) == dim && (t->stride(2) == 1 || dim <= 1),
                "key and value must be [", batch, ", ", heads, ", ", dim,
                "] with a contiguous last dimension, got ", t->sizes());
  }
  const at::Tensor index = slots.contiguous();
  const int64_t* slot = index.const_data_ptr<int64_t>();
  const int64_t item = pool.element_size(), row_bytes = dim * item;
  char* base = static_cast<char*>(pool.data_ptr());
  const char* sources[2] = {static_cast<const char*>(key.const_data_ptr()),
                            static_cast<const char*>(value.const_data_ptr())};
  const int64_t strides[2][2] = {{key.stride(0), key.stride(1)}, {value.stride(0), value.stride(1)}};
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t page = slot[b] / block, offset = slot[b] % block;
    TORCH_CHECK(slot[b] >= 0 && page < pages, "slot ", slot[b], " outside the pool");
    for (int kv = 0; kv < 2; ++kv) {
      for (int64_t h = 0; h < heads; ++h) {
        char* dst = base + (((page * 2 + kv) * heads + h) * block + offset) * row_bytes;
        const char* src = sources[kv] + (b * strides[kv][0] + h * strides[kv][1]) * item;
        std::memcpy(dst, src, row_bytes);
      }
    }
  }
}

bool has_gemv() {
  static const bool available = has_avx512_bf16();
  return available;
}

// x [1, k] bf16 (contiguous) times weight [n, k]^T bf16 (contiguous) -> [1, n] bf16: a linear
// layer without bias at batch 1, for weights small enough that oneDNN's per-call setup costs
// as much as reading them. Rows are split across the intra-op threads.
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(has_gemv(), "gemv_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() &&
                  x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "x and weight must be bf16 CPU tensors");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [n, k]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.size(1) == k && x.is_contiguous(),
              "x must be a contiguous [1, ", k, "], got ", x.sizes());
  at::Tensor out = at::empty({1, n}, x.options());
  const fk::GemvArgs args{reinterpret_cast<const uint16_t*>(weight.const_data_ptr()),
                          reinterpret_cast<const uint16_t*>(x.const_data_ptr()), k,
                          reinterpret_cast<uint16_t*>(out.mutable_data_ptr())};
  // ~64 KiB of weights per task: small layers stay on the calling thread.
  const int64_t grain = std::max<int64_t>(4, (int64_t{1} << 15) / std::max<int64_t>(1, k));
  at::parallel_for(0, n, grain,
                   [&](int64_t begin, int64_t end) { fk::gemv_bf16_avx512(args, begin, end); });
  return out;
}

// AMX-BF16 in the CPU (CPUID.(7,0):EDX bits 22 and 24) and the tile state granted to this
// process by Linux (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; oneDNN asks too,
// asking again is harmless). Without the grant the first tile instruction kills the process.
bool has_small_gemm() {
  static const bool available = [] {
#if defined(__x86_64__) && defined(SYS_arch_prctl)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!fk::kGemmAmxCompiled || !has_avx512() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
      return false;
    if (!(edx & (1u << 22)) || !(edx & (1u << 24))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;
#endif
  }();
  return available;
}

// x [m, k] bf16 (last dimension contiguous, any row stride) times weight [n, k]^T bf16
// (contiguous) -> [m, n] bf16: a bias-free linear layer at a few rows (decode batches), reading
// each weight row once for all of them. Groups of 64 output features are split across the
// intra-op threads; x is rearranged once on the calling thread.
at::Tensor gemm_bf16_small(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(has_small_gemm(), "gemm_bf16_small needs a CPU with AMX-BF16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() &&
                  x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "x and weight must be bf16 CPU tensors");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [n, k]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be [m, ", k, "], got ", x.sizes());
  const at::Tensor input = x.stride(1) == 1 || k <= 1 ? x : x.contiguous();
  const int64_t m = input.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  if (k == 0) return out.zero_();
  const int64_t chunks = (k + 31) / 32, m_blocks = (m + 15) / 16;
  at::Tensor packed = at::empty({m_blocks * chunks * 16 * 32}, x.options());
  auto* xv = reinterpret_cast<uint16_t*>(packed.mutable_data_ptr());
  fk::pack_x_vnni(reinterpret_cast<const uint16_t*>(input.const_data_ptr()), m, k,
                  input.stride(0), xv);
  const fk::SmallGemmArgs args{reinterpret_cast<const uint16_t*>(weight.const_data_ptr()), xv,
                               m, n, k, reinterpret_cast<uint16_t*>(out.mutable_data_ptr()), n};
  const int64_t groups = (n + fk::kSmallGemmGroup - 1) / fk::kSmallGemmGroup;
  // ~64 KiB of weights per task, as the GEMV: small layers stay on the calling thread.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, fk::kSmallGemmGroup * k));
  at::parallel_for(0, groups, grain,
                   [&](int64_t begin, int64_t end) { fk::gemm_bf16_amx(args, begin, end); });
  return out;
}

}  // namespace

TORCH_LIBRARY(sparsekv_fused, m) {
  m.def("available_isas", &available_isas);
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset, str isa=\"\") -> Tensor",
        &rms_norm);
  m.def(
      "add_rms_norm(Tensor hidden, Tensor delta, Tensor weight, float eps, bool unit_offset, "
      "str isa=\"\") -> (Tensor, Tensor)",
      &add_rms_norm);
  m.def("silu_mul(Tensor x, str isa=\"\") -> Tensor", &silu_mul);
  m.def("gelu_tanh_mul(Tensor x, str isa=\"\") -> Tensor", &gelu_tanh_mul);
  m.def("has_gemv_bf16", &has_gemv);
  m.def("gemv_bf16(Tensor x, Tensor weight) -> Tensor", &gemv_bf16);
  m.def("has_gemm_bf16_small", &has_small_gemm);
  m.def("gemm_bf16_small(Tensor x, Tensor weight) -> Tensor", &gemm_bf16_small);
  m.def("write_kv_(Tensor(a!) pool, Tensor slots, Tensor key, Tensor value) -> ()", &write_kv_);
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor signed_sin, str isa=\"\") -> ()", &rotary_);
}
