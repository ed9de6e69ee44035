// AVX-512 + AVX512-BF16 packed-weight kernels: bf16-activation GEMV / small-M GEMM for Q4_0,
// Q4_1 and Q8_0 (quant_bf16_impl.h), and the 8-lane fp32 kernels of quant_impl.h for fp32
// activations and the other formats.
#include <stdint.h>

#include "quant.h"

// GCC 10 or later knows the avx512bf16 target; other compilers get the empty table below, so
// the extension still builds with its avx2 and generic variants.
#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 10
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
// Intrinsics are gnu_inline, never emitted out of line: safe here, unlike standard-library
// headers (see quant.h).
#include <immintrin.h>
namespace sparsekv_quant {
namespace isa_avx512_bf16 {
#define QK_AVX2 1
#include "quant_impl.h"
#include "kernel_common_impl.h"
#include "small_m_impl.h"
#include "quant_bf16_impl.h"
#undef QK_AVX2
}  // namespace isa_avx512_bf16

const QuantTable kQuantAvx512Bf16 = {"avx512_bf16",
                                     8,
                                     &isa_avx512_bf16::gemv,
                                     &isa_avx512_bf16::gemm,
                                     &isa_avx512_bf16::dequantize,
                                     isa_avx512_bf16::kBf16Formats,
                                     &isa_avx512_bf16::gemv_bf16,
                                     &isa_avx512_bf16::gemm_bf16};
}  // namespace sparsekv_quant
#else
namespace sparsekv_quant {
const QuantTable kQuantAvx512Bf16 = {"avx512_bf16", 0, nullptr, nullptr, nullptr,
                                     0,             nullptr, nullptr};
}  // namespace sparsekv_quant
#endif
