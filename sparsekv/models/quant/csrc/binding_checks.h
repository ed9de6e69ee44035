// Argument checks and row bookkeeping of the packed-weight torch operators (binding.cpp and
// int8_rows_binding.cpp; baseline ISA): packed row sizes per format, weight / x / y / bias checks, the thread split's
// grain and x's block sums.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <vector>

#include "quant.h"
#include "repack.h"

namespace qk = sparsekv_quant;

namespace {

bool is_x16(int64_t format) {
  return format == qk::kQ4_0X16 || format == qk::kQ4_1X16 || format == qk::kQ8_0X16;
}

// Weight rows per row of the packed tensor: 16 for the x16 group layouts, else 1.
int64_t rows_per_row(int64_t format) { return is_x16(format) ? 16 : 1; }

// Bytes one row of the packed tensor takes in `format` for k inputs (x16: a group of 16).
int64_t row_bytes_of(int64_t format, int64_t k) {
  switch (format) {
    case qk::kQ4_0: return k / qk::kBlock * 18;
    case qk::kQ4_1: return k / qk::kBlock * 20;
    case qk::kQ8_0: return k / qk::kBlock * 34;
    case qk::kInt8Row: return 4 + k;
    case qk::kBf16Row: return 2 * k;
    case qk::kQ4_K: return k / 256 * 144;
    case qk::kQ6_K: return k / 256 * 210;
    case qk::kQ5_0: return k / qk::kBlock * 22;
    case qk::kQ4_0X16:
    case qk::kQ4_1X16:
    case qk::kQ8_0X16: return k / qk::kBlock * qk::x16_layout(format).group_block_bytes();
    default: TORCH_CHECK(false, "unknown packed format code ", format);
  }
}

void check_weight(const at::Tensor& w, int64_t format, int64_t k) {
  TORCH_CHECK(format >= 0 && format < qk::kNumFormats, "unknown packed format code ", format);
  const bool super = format == qk::kQ4_K || format == qk::kQ6_K;
  const bool blocks = format == qk::kQ4_0 || format == qk::kQ4_1 || format == qk::kQ8_0 ||
                      format == qk::kQ5_0 || is_x16(format);
  TORCH_CHECK(k >= 0 && (!blocks || k % qk::kBlock == 0),
              "in_features must be a multiple of 32 for a block format, got ", k);
  TORCH_CHECK(k >= 0 && (!super || k % 256 == 0),
              "in_features must be a multiple of 256 for a k-quant format, got ", k);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 &&
                  w.is_contiguous(),
              "weight must be a contiguous CPU uint8 [out_features, row_bytes]");
  TORCH_CHECK(w.size(1) == row_bytes_of(format, k), "weight rows must hold ",
              row_bytes_of(format, k), " bytes for ", k, " inputs, got ", w.size(1));
}

// A call with more than 64 KiB of packed weights is split into equal parts, one per thread, so
// every decode-sized layer of a small model runs on all threads (SmolLM2's 337.5 KiB fused QKV
// on both of 2): decode reads the weights, and one core alone does not saturate memory. A call
// joins its threads at the end, so on cores that other processes keep busy a helper thread that
// is not running holds every join for a scheduler slice: there, give `--threads` no more
// threads than idle cores.
constexpr int64_t kMinTaskBytes = int64_t{1} << 16;

int64_t grain_rows(int64_t row_bytes, int64_t multiple) {
  const int64_t rows = std::max<int64_t>(1, kMinTaskBytes / std::max<int64_t>(1, row_bytes));
  return (rows + multiple - 1) / multiple * multiple;
}

// [m, k / 32] fp32 sums of each block of 32 of x's rows (x fp32 or bf16; the 4-bit formats'
// offsets factor out of the dot product on them).
std::vector<float> block_sums(const at::Tensor& x, int64_t m, int64_t k) {
  const int64_t blocks = k / qk::kBlock;
  std::vector<float> sums(m * blocks);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  for (int64_t r = 0; r < m; ++r) {
    const float* xf = bf16 ? nullptr : x.const_data_ptr<float>() + r * x.stride(0);
    const auto* xh = bf16 ? x.const_data_ptr<at::BFloat16>() + r * x.stride(0) : nullptr;
    for (int64_t b = 0; b < blocks; ++b) {
      float s = 0.0f;
      for (int j = 0; j < qk::kBlock; ++j)
        s += bf16 ? static_cast<float>(xh[b * qk::kBlock + j]) : xf[b * qk::kBlock + j];
      sums[r * blocks + b] = s;
    }
  }
  return sums;
}

// bias, when given, is a contiguous CPU float32 [n].
void check_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (bias.has_value())
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat &&
                    bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "bias must be a contiguous CPU float32 [", n, "], got ", bias->scalar_type(),
                " ", bias->sizes());
}

void check_matmul_args(const at::Tensor& x, int64_t k, int64_t n, const at::Tensor& y,
                       int64_t col, const c10::optional<at::Tensor>& bias) {
  const auto xt = x.scalar_type(), yt = y.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && (xt == at::kFloat || xt == at::kBFloat16) && x.dim() == 2 &&
                  x.size(1) == k && (x.stride(1) == 1 || k <= 1),
              "x must be a CPU float32 or bfloat16 [m, ", k,
              "] with a contiguous last dimension, got ", xt, " ", x.sizes());
  const int64_t m = x.size(0);
  TORCH_CHECK(y.device().is_cpu() && (yt == at::kFloat || yt == at::kBFloat16) && y.dim() == 2 &&
                  y.size(0) == m && (y.stride(1) == 1 || y.size(1) <= 1),
              "y must be a CPU float32 or bfloat16 [", m,
              ", cols] with a contiguous last dimension, got ", yt, " ", y.sizes());
  TORCH_CHECK(col >= 0 && n <= y.size(1) && col <= y.size(1) - n, "columns ", col, " + ", n,
              " do not fit in y's ", y.size(1));  // no col + n: it may overflow
  check_bias(bias, n);
}

}  // namespace
