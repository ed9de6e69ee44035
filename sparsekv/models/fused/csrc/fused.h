// Plain-C++ interface between the torch binding and the per-ISA row kernels of the fused ops.
//
// As in the attention extension (sparsekv/attention/cpu/csrc/kernels.h), the ISA translation
// units (isa_*.cpp) include no torch or standard-library headers: each is compiled under its own
// `#pragma GCC target`, and an inline function shared with the binding could be merged by the
// linker into its AVX-512 copy and then run on a CPU without AVX-512. They see only these plain
// structs and raw pointers. bf16 elements are passed as their raw 16-bit patterns.
//
// Every kernel handles the rows [begin, end) of its arguments; the binding splits rows across
// the intra-op threads. Math is fp32; results are rounded to the input dtype exactly where the
// eager PyTorch code rounds (see each field's comment and fused_impl.h).
#pragma once

#include <stdint.h>

namespace sparsekv_fused {

// Row r of a strided operand starts at element (r / inner) * stride_outer +
// (r % inner) * stride_inner; its `n` elements are contiguous.
struct RowLayout {
  int64_t inner, stride_outer, stride_inner;
};

// out = rms_norm(x (+ delta)): y = s * (1 / sqrt(mean(s^2) + eps)) * w, with s = x + delta
// rounded to the input dtype (written to sum_out) when delta is given, else s = x.
struct NormArgs {
  const void* x;       // rows of n elements (layout x_rows)
  const void* delta;   // nullptr, or rows of n elements (layout delta_rows)
  const float* weight;  // [n] fp32, the unit offset already added
  RowLayout x_rows, delta_rows;
  int64_t n;
  float eps;
  bool bf16;       // element type of x, delta, sum_out and out: bf16, else fp32
  void* sum_out;   // [rows, n] contiguous, or nullptr without delta
  void* out;       // [rows, n] contiguous
};

// out[r] = act(gate) * up with gate = x[r, :n], up = x[r, n:2n]; act's result is rounded to
// the input dtype before the product, as eager `act(gate) * up` does.
struct GluArgs {
  const void* x;  // [rows, 2n], row stride x_stride elements
  int64_t n, x_stride;
  bool bf16;
  void* out;  // [rows, n] contiguous
  // bf16 only, optional: act of every bf16 bit pattern, rounded to bf16 ([65536 + 1], the last
  // entry padding for 32-bit gathers), as this variant's own kernel computes it. The AVX-512
  // variant then looks the activation up instead of evaluating exp (same results, 3x fewer
  // instructions); the others ignore it.
  const uint16_t* lut;
};

// In place, per token t and head h: x = x * cos + cat(x2, x1) * signed_sin, with x * cos
// rounded to the input dtype before the sum (eager `addcmul(x * cos, swapped, signed_sin)`).
struct RotaryArgs {
  void* x;  // [tokens, heads, head_dim], strides (token_stride, head_stride, 1)
  const void* cos;  // [tokens, head_dim], row stride table_stride, x's dtype
  const void* sin;  // signed sin, same layout
  int64_t heads, head_dim, token_stride, head_stride, table_stride;
  bool bf16;
};

struct FusedTable {
  const char* name;
  int width;  // fp32 lanes of a vector; 0: not compiled for this target
  void (*rms_norm)(const NormArgs&, int64_t begin, int64_t end);
  void (*silu_mul)(const GluArgs&, int64_t begin, int64_t end);
  void (*gelu_tanh_mul)(const GluArgs&, int64_t begin, int64_t end);
  void (*rotary)(const RotaryArgs&, int64_t begin, int64_t end);  // rows are tokens
};

// y [n] = W [n, k] x [k] in bf16 (raw 16-bit patterns), fp32 accumulation; rows [begin, end).
struct GemvArgs {
  const uint16_t* w;  // [n, k] contiguous
  const uint16_t* x;  // [k]
  int64_t k;
  uint16_t* y;  // [n]
};

// gemv_avx512bf16.cpp: runs only where the CPU has AVX512-BF16 (and the compiler targets it:
// kGemvAvx512Bf16Compiled).
void gemv_bf16_avx512(const GemvArgs& args, int64_t begin, int64_t end);
extern const bool kGemvAvx512Bf16Compiled;

// y [m, n] = x [m, k] W [n, k]^T in bf16 for a few rows of x (gemm_amx_bf16.cpp), fp32
// accumulation; x arrives rearranged by pack_x_vnni.
struct SmallGemmArgs {
  const uint16_t* w;   // [n, k] contiguous
  const uint16_t* xv;  // x in pack_x_vnni's layout
  int64_t m, n, k;
  uint16_t* y;  // [m, n], row stride y_stride
  int64_t y_stride;
};

// Runs only where the CPU has AMX-BF16 and the OS granted this process the tile state (and the
// compiler targets it: kGemmAmxCompiled). gemm_bf16_amx handles output-feature groups
// [begin, end) of kSmallGemmGroup rows, configuring the tiles of the calling thread.
constexpr int64_t kSmallGemmGroup = 64;
void pack_x_vnni(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, uint16_t* xv);
void gemm_bf16_amx(const SmallGemmArgs& args, int64_t begin, int64_t end);
extern const bool kGemmAmxCompiled;

extern const FusedTable kTableAvx512;
extern const FusedTable kTableAvx2;
extern const FusedTable kTableGeneric;

}  // namespace sparsekv_fused
