// torch.ops.sparsekv_quant.int8_rows_matmul: prefill-sized matmuls on per-channel int8 weights
// with x's rows quantized to int8 (W8A8, one dynamic scale per row), the products in oneDNN's
// int8 GEMM (at::_int_mm: vpdpbusd / AMX-INT8; vpmaddubsw on AVX2) between the variant's two
// element-wise passes (int8_rows_impl.h, int8_rows_avx2_impl.h). Compiled for the baseline ISA,
// as binding.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "binding_checks.h"
#include "quant.h"

namespace sparsekv_quant {
const QuantTable& table_named(c10::string_view isa);  // binding.cpp
}

namespace {

// y [m, n] = x [m, k] W^T (+ bias) in x's dtype (bf16 or fp32) for W [n, k] in the int8 row
// format (code 3: an fp32 scale, then k int8 codes per row); bias fp32 [n]. With an
// `activation` ("silu", "gelu_tanh") W is a fused gate / up projection (gate rows, then up
// rows) and y [m, n / 2] = act(gate) * up, computed from the fp32 results. Rows of x go in
// near-equal chunks of at most `chunk_rows` (fewer for a wide W: ~8 MiB of int32 products):
// quantized on the threads, multiplied in int32, scaled back while the chunk's products are
// still in cache.
at::Tensor int8_rows_matmul(const at::Tensor& x, const at::Tensor& w, int64_t k,
                            const c10::optional<at::Tensor>& bias, int64_t chunk_rows,
                            c10::string_view isa, c10::string_view activation) {
  check_weight(w, qk::kInt8Row, k);
  // 127 * 127 * k must fit the int32 products
  TORCH_CHECK(k > 0 && k <= 133143, "int8_rows_matmul: in_features must be in [1, 133143], got ", k);
  TORCH_CHECK(chunk_rows >= 1, "int8_rows_matmul: chunk_rows must be positive, got ", chunk_rows);
  TORCH_CHECK(x.dim() == 2, "x must be a CPU float32 or bfloat16 [m, ", k, "], got ", x.sizes());
  const int64_t m = x.size(0), n = w.size(0);
  const int act = activation.empty() ? -1 : activation == "silu" ? 0
                  : activation == "gelu_tanh" ? 1 : -2;
  TORCH_CHECK(act != -2, "int8_rows_matmul: activation must be '', 'silu' or 'gelu_tanh', got '",
              std::string(activation), "'");
  TORCH_CHECK(act < 0 || n % 2 == 0, "int8_rows_matmul: a gated activation needs an even ",
              "number of output features (gate, then up), got ", n);
  const int64_t out = act < 0 ? n : n / 2;
  at::Tensor y = at::empty({m, out}, x.options());
  check_matmul_args(x, k, out, y, 0, c10::nullopt);
  check_bias(bias, n);  // gate and up: n, not y's out columns
  const auto& table = qk::table_named(isa);
  TORCH_CHECK(table.quantize_rows != nullptr, "int8_rows_matmul needs a kernel variant with int8 ",
              "GEMM passes (avx512_amx, avx512_vnni, avx2), got '", table.name, "'");
  if (m == 0 || n == 0) return y;
  const uint8_t* rows = w.const_data_ptr<uint8_t>();
  std::vector<float> col_scale(n);
  for (int64_t i = 0; i < n; ++i) std::memcpy(&col_scale[i], rows + i * (4 + k), 4);
  // [k, n] int8 view of the codes (column-major, leading dimension 4 + k): oneDNN reads it as is
  const at::Tensor codes_t = w.view(at::kChar).narrow(1, 4, k).t();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const size_t elem = bf16 ? 2 : 4;
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  auto* yp = static_cast<char*>(y.mutable_data_ptr());
  const float* bp = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  // at most chunk_rows, and int32 products of at most ~8 MiB (a wide output head: 64 rows)
  const int64_t cap = std::max<int64_t>(64, (int64_t(8) << 20) / (4 * n));
  const int64_t most = std::min(chunk_rows, cap);
  const int64_t chunks = (m + most - 1) / most, step = (m + chunks - 1) / chunks;
  at::Tensor q = at::empty({step, k}, x.options().dtype(at::kChar));
  at::Tensor products = at::empty({step, n}, x.options().dtype(at::kInt));
  std::vector<float> row_scale(step);
  for (int64_t r0 = 0; r0 < m; r0 += step) {
    const int64_t count = std::min(step, m - r0);
    const at::Tensor qc = q.narrow(0, 0, count);
    int8_t* qp = qc.mutable_data_ptr<int8_t>();
    const void* xc = xp + r0 * x.stride(0) * elem;
    at::parallel_for(0, count, 16, [&](int64_t b, int64_t e) {
      table.quantize_rows(xc, bf16, x.stride(0), k, b, e, qp, row_scale.data());
    });
    at::Tensor acc = products.narrow(0, 0, count);
    at::_int_mm_out(acc, qc, codes_t);
    const int32_t* ap = acc.const_data_ptr<int32_t>();
    void* yc = yp + r0 * out * elem;
    at::parallel_for(0, count, 8, [&](int64_t b, int64_t e) {
      if (act < 0)
        table.scale_rows(ap, n, b, e, row_scale.data(), col_scale.data(), bp, yc, bf16, out);
      else
        table.scale_rows_gated(ap, out, b, e, row_scale.data(), col_scale.data(), bp, yc, bf16,
                               out, act);
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparsekv_quant, m) {
  m.def(
      "int8_rows_matmul(Tensor x, Tensor weight, int in_features, Tensor? bias=None, "
      "int chunk_rows=512, str isa=\"\", str activation=\"\") -> Tensor",
      &int8_rows_matmul);
}
