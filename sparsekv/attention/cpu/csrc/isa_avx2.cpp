// AVX2 + FMA kernels (8 fp32 lanes): decode attention, window scores (kernel_impl.h) and
// fp32 causal prefill attention (prefill_fma.h).
#include <stdint.h>

#include "kernels.h"
#include "prefill.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
// Intrinsics are gnu_inline, never emitted out of line: safe here, unlike standard-library
// headers (see kernels.h).
#include <immintrin.h>
namespace sparsekv_cpu {
namespace isa_avx2 {
#define SKV_AVX2 1
#define SKV_W 8
#include "kernel_impl.h"
#include "prefill_fma.h"
#undef SKV_W
#undef SKV_AVX2
}  // namespace isa_avx2

const KernelTable kTableAvx2 = {
    "avx2",
    8,
    isa_avx2::kWinSlots,
    isa_avx2::kWinRows,
    &isa_avx2::decode_scratch,
    &isa_avx2::window_scratch,
    &isa_avx2::decode_item,
    &isa_avx2::decode_combine,
    &isa_avx2::window_pages,
};
const PrefillKernel kPrefillAvx2 = {&isa_avx2::prefill_scratch_fma, &isa_avx2::prefill_item_fma};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const KernelTable kTableAvx2 = {"avx2", 0, 0, 0, nullptr, nullptr, nullptr, nullptr, nullptr};
const PrefillKernel kPrefillAvx2 = {nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
