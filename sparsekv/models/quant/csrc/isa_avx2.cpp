// AVX2 + FMA + F16C packed-weight kernels (8 fp32 lanes).
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
#undef QK_AVX2
}  // namespace isa_avx2

const QuantTable kQuantAvx2 = {"avx2", 8, &isa_avx2::gemv, &isa_avx2::gemm,
                               &isa_avx2::dequantize, 0, nullptr, nullptr};
}  // namespace sparsekv_quant
#else
namespace sparsekv_quant {
const QuantTable kQuantAvx2 = {"avx2", 0, nullptr, nullptr, nullptr, 0, nullptr, nullptr};
}  // namespace sparsekv_quant
#endif
