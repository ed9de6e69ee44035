// AVX2 + FMA + F16C packed-weight kernels (8 fp32 lanes), the int8-activation kernels of the
// x16 layouts for bf16 x (quant_x16_avx2_impl.h: vpmaddubsw / vpmaddwd instead of vpdpbusd,
// results equal to the avx512_vnni variant's), and the passes around the int8 GEMM of
// prefill-sized W8A8 matmuls (int8_rows_avx2_impl.h).
#include <stdint.h>

#include "quant.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
// Intrinsics are gnu_inline, never emitted out of line: safe here, unlike standard-library
// headers (see quant.h).
#include <immintrin.h>
namespace sparsekv_quant {
namespace isa_avx2 {
#define QK_AVX2 1
#include "quant_impl.h"
#include "kernel_common_impl.h"
#include "quant_x16_avx2_impl.h"
#include "int8_rows_avx2_impl.h"
#undef QK_AVX2
}  // namespace isa_avx2

const QuantTable kQuantAvx2 = {"avx2",
                               8,
                               &isa_avx2::gemv,
                               &isa_avx2::gemm,
                               &isa_avx2::dequantize,
                               0,
                               nullptr,
                               nullptr,
                               0,
                               &isa_avx2::quantize_x,
                               nullptr,
                               &isa_avx2::gemm_x16,
                               &isa_avx2::quantize_rows,
                               &isa_avx2::scale_rows,
                               &isa_avx2::scale_rows_gated};
}  // namespace sparsekv_quant
#else
namespace sparsekv_quant {
const QuantTable kQuantAvx2 = {"avx2", 0, nullptr, nullptr, nullptr, 0, nullptr, nullptr};
}  // namespace sparsekv_quant
#endif
