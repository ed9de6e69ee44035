// AVX2 + FMA row kernels (8 fp32 lanes).
#include <stdint.h>

#include "fused.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
// Intrinsics are gnu_inline, never emitted out of line: safe here, unlike standard-library
// headers (see fused.h).
#include <immintrin.h>
namespace sparsekv_fused {
namespace isa_avx2 {
#define FK_W 8
#include "fused_impl.h"
#undef FK_W
}  // namespace isa_avx2

const FusedTable kTableAvx2 = {
    "avx2",
    8,
    &isa_avx2::rms_norm,
    &isa_avx2::silu_mul,
    &isa_avx2::gelu_tanh_mul,
    &isa_avx2::rotary,
};
}  // namespace sparsekv_fused
#else
namespace sparsekv_fused {
const FusedTable kTableAvx2 = {"avx2", 0, nullptr, nullptr, nullptr, nullptr};
}  // namespace sparsekv_fused
#endif
