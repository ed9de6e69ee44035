// AVX-512F kernels (16 fp32 lanes): decode attention, window scores (kernel_impl.h) and fp32
// causal prefill attention (prefill_fma.h) for AVX-512 CPUs without AVX512-BF16.
#include <stdint.h>

#include "kernels.h"
#include "prefill.h"

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx2,fma,f16c")
// Intrinsics are gnu_inline, never emitted out of line: safe here, unlike standard-library
// headers (see kernels.h).
#include <immintrin.h>
namespace sparsekv_cpu {
namespace isa_avx512 {
#define SKV_AVX512 1
#define SKV_W 16
#include "kernel_impl.h"
#include "prefill_fma.h"
#undef SKV_W
#undef SKV_AVX512
}  // namespace isa_avx512

const KernelTable kTableAvx512 = {
    "avx512",
    16,
    isa_avx512::kWinSlots,
    isa_avx512::kWinRows,
    &isa_avx512::decode_scratch,
    &isa_avx512::window_scratch,
    &isa_avx512::decode_item,
    &isa_avx512::decode_combine,
    &isa_avx512::window_pages,
};
const PrefillKernel kPrefillAvx512 = {&isa_avx512::prefill_scratch_fma, &isa_avx512::prefill_item_fma};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const KernelTable kTableAvx512 = {"avx512", 0, 0, 0, nullptr, nullptr, nullptr, nullptr, nullptr};
const PrefillKernel kPrefillAvx512 = {nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
