// AVX-512F/BW/VL row kernels (16 fp32 lanes).
#include <stdint.h>

#include "fused.h"

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
// Intrinsics are gnu_inline, never emitted out of line: safe here, unlike standard-library
// headers (see fused.h).
#include <immintrin.h>
namespace sparsekv_fused {
namespace isa_avx512 {
#define FK_W 16
#include "fused_impl.h"
#undef FK_W
}  // namespace isa_avx512

const FusedTable kTableAvx512 = {
    "avx512",
    16,
    &isa_avx512::rms_norm,
    &isa_avx512::silu_mul,
    &isa_avx512::gelu_tanh_mul,
    &isa_avx512::rotary,
};
}  // namespace sparsekv_fused
#else
namespace sparsekv_fused {
const FusedTable kTableAvx512 = {"avx512", 0, nullptr, nullptr, nullptr, nullptr};
}  // namespace sparsekv_fused
#endif
