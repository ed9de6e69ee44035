// Torch operators of the packed-weight linears (torch.ops.sparsekv_quant.*): argument checks,
// threading, and the run-time choice of the ISA variant. Compiled for the baseline ISA, with
// light ATen headers as the fused ops' binding.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "binding_checks.h"
#include "quant.h"
#include "repack.h"

namespace qk = sparsekv_quant;

namespace {

bool has_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// AVX-512 F/BW/VL (with AVX2) plus one extension; GCC 10 or later, as the isa_avx512_*.cpp
// translation units need (their tables are empty otherwise).
#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 10
bool has_avx512() {
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
bool has_avx512_bf16() { return has_avx512() && __builtin_cpu_supports("avx512bf16"); }
bool has_avx512_vnni() { return has_avx512() && __builtin_cpu_supports("avx512vnni"); }
// AMX-TILE and AMX-INT8 in CPUID (leaf 7: EDX bits 24 and 25) and the tile state granted to
// this process: Linux enables AMX per process on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, process-wide and permanent; asking again is harmless), and without the
// grant the first tile instruction kills the process.
bool has_amx_int8() {
  static const bool available = [] {
#if defined(__linux__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!has_avx512_vnni() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!((edx >> 24) & 1u) || !((edx >> 25) & 1u)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;
#endif
  }();
  return available;
}
#else
bool has_avx512_bf16() { return false; }
bool has_avx512_vnni() { return false; }
bool has_amx_int8() { return false; }
#endif

bool always() { return true; }

struct Variant {
  const char* name;
  const qk::QuantTable* table;
  bool (*cpu_runs)();
};

const Variant kVariants[] = {  // fastest first
    {"avx512_amx", &qk::kQuantAvx512Amx, has_amx_int8},
    {"avx512_vnni", &qk::kQuantAvx512Vnni, has_avx512_vnni},
    {"avx512_bf16", &qk::kQuantAvx512Bf16, has_avx512_bf16},
    {"avx2", &qk::kQuantAvx2, has_avx2},
    {"generic", &qk::kQuantGeneric, always},
};

bool usable(const Variant& v) { return v.table->width > 0 && v.cpu_runs(); }

std::string available_isas() {  // comma-separated, fastest first
  std::string out;
  for (const auto& v : kVariants)
    if (usable(v)) out += (out.empty() ? "" : ",") + std::string(v.name);
  return out;
}

// `isa` empty: the fastest variant this CPU runs.
const qk::QuantTable& table_for(c10::string_view isa) {
  static const qk::QuantTable* fastest = [] {
    for (const auto& v : kVariants)
      if (usable(v)) return v.table;
    return &qk::kQuantGeneric;
  }();
  if (isa.empty()) return *fastest;
  for (const auto& v : kVariants)
    if (isa == v.name && usable(v)) return *v.table;
  TORCH_CHECK(false, "packed-weight kernel variant '", std::string(isa),
              "' is not supported on this CPU");
}


// Runs `kernel` over the n weight rows, split over the threads above kMinTaskBytes of weights.
// The x16 layouts are split at whole groups of 16 rows (at::parallel_for cuts a range into
// equal parts, not at multiples of its grain).
void run_rows(const qk::MatmulArgs& args, int64_t n,
              void (*kernel)(const qk::MatmulArgs&, int64_t, int64_t)) {
  const int64_t group = rows_per_row(args.format);
  const int64_t grain = grain_rows(args.row_bytes / group, std::max<int64_t>(4, group)) / group;
  at::parallel_for(0, n / group, grain,
                   [&](int64_t begin, int64_t end) { kernel(args, begin * group, end * group); });
}

// The int8-activation path: bf16 x quantized per block of 32 (rows split over the threads),
// then the variant's gemm_q8 over the weight rows.
void run_q8(const at::Tensor& x, const qk::QuantTable& table, qk::MatmulArgs& args, int64_t n,
            const at::Tensor& y, const c10::optional<at::Tensor>& bias) {
  const int64_t m = args.m, k = args.k, blocks = k / qk::kBlock;
  // per row: k high codes, then k residual codes; zero rows up to a multiple of 8 (the AMX
  // kernel's tiles read whole groups of 8 rows)
  std::vector<int8_t> codes(2 * ((m + 7) / 8 * 8) * k);
  std::vector<float> scales(m * blocks), x_sums(m * blocks);
  std::vector<int32_t> code_sums(m * blocks);
  const auto* xb = reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>());
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    table.quantize_x(xb, args.x_stride, k, begin, end, codes.data(), scales.data(),
                     code_sums.data(), x_sums.data());
  });
  args.x_q8 = codes.data();
  args.x_q8_scales = scales.data();
  args.x_q8_sums = code_sums.data();
  args.x_block_sums = x_sums.data();
  if (y.scalar_type() == at::kBFloat16) {
    args.y_bf16 = reinterpret_cast<uint16_t*>(y.mutable_data_ptr<at::BFloat16>());
  } else {
    args.y = y.mutable_data_ptr<float>();
  }
  args.bias = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  run_rows(args, n, is_x16(args.format) ? table.gemm_x16 : table.gemm_q8);
}

// y[:, col : col + n] = x [m, k] W^T (+ bias) for the packed W [n, k]; x and y fp32 or bf16
// (bf16 y: the fp32 result rounded once), bias fp32 [n], last dimensions contiguous. One row of
// x goes through the GEMV, more through the tiled GEMM. bf16 x runs the variant's bf16 kernels
// where it has them for `format`, else is converted to fp32 for its fp32 kernels, whose bias
// and bf16 rounding are applied here.
void matmul_(const at::Tensor& x, const at::Tensor& w, int64_t format, int64_t k,
             const at::Tensor& y, int64_t col, c10::string_view isa,
             const c10::optional<at::Tensor>& bias) {
  check_weight(w, format, k);
  const int64_t m = x.size(0), n = w.size(0) * rows_per_row(format);
  check_matmul_args(x, k, n, y, col, bias);
  if (m == 0 || n == 0) return;
  const auto& table = table_for(isa);
  TORCH_CHECK(!is_x16(format) || (x.scalar_type() == at::kBFloat16 && table.gemm_x16),
              "x16-repacked weights need bf16 x and the avx512_amx, avx512_vnni or avx2 kernel "
              "variant, got ",
              x.scalar_type(), " x on '", table.name, "'");
  const bool y_bf16 = y.scalar_type() == at::kBFloat16;
  qk::MatmulArgs args{w.const_data_ptr<uint8_t>(), w.size(1), static_cast<int>(format),
                      nullptr, m, k, x.stride(0), nullptr, nullptr, y.stride(0), col};
  std::vector<float> sums;
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  if (x_bf16 && (is_x16(format) || (table.q8_formats >> format & 1u))) {
    run_q8(x, table, args, n, y, bias);
    return;
  }
  if (x_bf16 && (table.bf16_formats >> format & 1u)) {
    args.x_bf16 = reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>());
    if (y_bf16) {
      args.y_bf16 = reinterpret_cast<uint16_t*>(y.mutable_data_ptr<at::BFloat16>());
    } else {
      args.y = y.mutable_data_ptr<float>();
    }
    args.bias = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
    if (format == qk::kQ4_1) {
      sums = block_sums(x, m, k);
      args.x_block_sums = sums.data();
    }
    run_rows(args, n, m == 1 ? table.gemv_bf16 : table.gemm_bf16);
    return;
  }
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  // fp32 results land in y's columns, or in a scratch [m, n] when y is bf16.
  const at::Tensor yf = y_bf16 ? at::empty({m, n}, y.options().dtype(at::kFloat)) : y;
  args.x = xf.const_data_ptr<float>();
  args.x_stride = xf.stride(0);
  args.y = yf.mutable_data_ptr<float>();
  args.y_stride = yf.stride(0);
  args.col = y_bf16 ? 0 : col;
  if (m == 1 && (format == qk::kQ4_0 || format == qk::kQ4_1 || format == qk::kQ4_K)) {
    sums = block_sums(xf, 1, k);
    args.x_block_sums = sums.data();
  }
  run_rows(args, n, m == 1 ? table.gemv : table.gemm);
  at::Tensor out = y_bf16 ? yf : y.narrow(1, col, n);
  if (bias.has_value()) out.add_(*bias);
  if (y_bf16) y.narrow(1, col, n).copy_(out);
}

// The source-format rows [n, row_bytes] of an x16 weight [n / 16, group bytes].
at::Tensor unpack_x16(const at::Tensor& w, int64_t format, int64_t k) {
  check_weight(w, format, k);
  TORCH_CHECK(is_x16(format), "unpack_x16 takes an x16 format code, got ", format);
  const int source = qk::x16_layout(format).source;
  at::Tensor rows = at::empty({w.size(0) * 16, row_bytes_of(source, k)}, w.options());
  const uint8_t* src = w.const_data_ptr<uint8_t>();
  uint8_t* dst = rows.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, w.size(0), 16, [&](int64_t g0, int64_t g1) {
    qk::unpack_x16(src, static_cast<int>(format), k, dst, rows.size(1), g0, g1);
  });
  return rows;
}

// W [n, row_bytes] in Q4_0 / Q4_1 / Q8_0 (n a multiple of 16) repacked to its x16 layout.
at::Tensor repack_x16(const at::Tensor& w, int64_t format, int64_t k) {
  check_weight(w, format, k);
  TORCH_CHECK(qk::x16_layout(format).source == format,
              "repack_x16 takes Q4_0, Q4_1 or Q8_0 (codes 0, 1, 2), got ", format);
  TORCH_CHECK(w.size(0) % 16 == 0, "repack_x16 needs a multiple of 16 rows, got ", w.size(0));
  const int64_t groups = w.size(0) / 16;
  const int64_t x16 = format == qk::kQ4_0 ? qk::kQ4_0X16 : format == qk::kQ4_1 ? qk::kQ4_1X16
                                                                               : qk::kQ8_0X16;
  at::Tensor out = at::empty({groups, row_bytes_of(x16, k)}, w.options());
  const uint8_t* src = w.const_data_ptr<uint8_t>();
  uint8_t* dst = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    qk::repack_x16(src, w.size(1), static_cast<int>(format), k, dst, g0, g1);
  });
  return out;
}

// W [n, k] dequantized to a new fp32 tensor (prefill-sized matmuls run densely on it).
at::Tensor dequantize(const at::Tensor& w, int64_t format, int64_t k, c10::string_view isa) {
  if (is_x16(format))
    return dequantize(unpack_x16(w, format, k), qk::x16_layout(format).source, k, isa);
  check_weight(w, format, k);
  const int64_t n = w.size(0);
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat));
  if (n == 0 || k == 0) return out;
  const auto& table = table_for(isa);
  const uint8_t* src = w.const_data_ptr<uint8_t>();
  float* dst = out.mutable_data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, n, grain_rows(row_bytes, 1), [&](int64_t begin, int64_t end) {
    table.dequantize(src, row_bytes, static_cast<int>(format), k, dst, begin, end);
  });
  return out;
}

}  // namespace

namespace sparsekv_quant {
// The kernel table of `isa` ("" the fastest) for the other binding files.
const QuantTable& table_named(c10::string_view isa) { return table_for(isa); }
}  // namespace sparsekv_quant

TORCH_LIBRARY(sparsekv_quant, m) {
  m.def("available_isas", &available_isas);
  m.def(
      "matmul_(Tensor x, Tensor weight, int format, int in_features, Tensor(a!) y, int col, "
      "str isa=\"\", Tensor? bias=None) -> ()",
      &matmul_);
  m.def("dequantize(Tensor weight, int format, int in_features, str isa=\"\") -> Tensor",
        &dequantize);
  m.def("repack_x16(Tensor weight, int format, int in_features) -> Tensor", &repack_x16);
  m.def("unpack_x16(Tensor weight, int format, int in_features) -> Tensor", &unpack_x16);
}
