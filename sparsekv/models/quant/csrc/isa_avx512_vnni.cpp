// AVX-512 + AVX512-VNNI packed-weight kernels: int8-activation GEMV / small-M GEMM for Q4_0,
// Q4_1 and Q8_0 (quant_q8_impl.h; bf16 x is quantized per block of 32 first), and the 8-lane
// fp32 kernels of quant_impl.h for fp32 activations and the other formats.
#include <stdint.h>

#include "quant.h"

// GCC 10 or later, as isa_avx512_bf16.cpp; other compilers get the empty table below.
#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 10
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
// Intrinsics are gnu_inline, never emitted out of line: safe here, unlike standard-library
// headers (see quant.h).
#include <immintrin.h>
namespace sparsekv_quant {
namespace isa_avx512_vnni {
#define QK_AVX2 1
#include "quant_impl.h"
#include "kernel_common_impl.h"
#include "small_m_impl.h"
#include "quant_q8_impl.h"
#include "quant_x16_impl.h"
#include "int8_rows_impl.h"
#undef QK_AVX2
}  // namespace isa_avx512_vnni

const QuantTable kQuantAvx512Vnni = {"avx512_vnni",
                                     8,
                                     &isa_avx512_vnni::gemv,
                                     &isa_avx512_vnni::gemm,
                                     &isa_avx512_vnni::dequantize,
                                     0,
                                     nullptr,
                                     nullptr,
                                     isa_avx512_vnni::kQ8Formats,
                                     &isa_avx512_vnni::quantize_x,
                                     &isa_avx512_vnni::gemm_q8,
                                     &isa_avx512_vnni::gemm_x16,
                                     &isa_avx512_vnni::quantize_rows,
                                     &isa_avx512_vnni::scale_rows,
                                     &isa_avx512_vnni::scale_rows_gated};
}  // namespace sparsekv_quant
#else
namespace sparsekv_quant {
const QuantTable kQuantAvx512Vnni = {"avx512_vnni", 0, nullptr, nullptr, nullptr,
                                     0,             nullptr, nullptr};
}  // namespace sparsekv_quant
#endif
