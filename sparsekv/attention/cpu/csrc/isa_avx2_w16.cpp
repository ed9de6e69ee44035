// AVX2 + FMA build of the 16-lane code: GCC splits each vector in two, so
// the code the AVX-512 variant runs is tested on AVX2 machines too (slower than avx2). Also
// the fused window-score kernel of AVX2 CPUs (window_fused_fma.h, variant "avx2"), whose
// passes work on blocks of 16 rows (its hot loops on 8-lane vectors).
#include <stdint.h>

#include "kernels.h"
#include "window_fused.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
// Intrinsics are gnu_inline, never emitted out of line: safe here, unlike standard-library
// headers (see kernels.h).
#include <immintrin.h>
namespace sparsekv_cpu {
namespace isa_avx2_w16 {
#define SKV_AVX2 1
#define SKV_W 16
#include "kernel_impl.h"
#include "window_fused_passes.h"
#include "window_fused_fma.h"
#undef SKV_W
#undef SKV_AVX2
}  // namespace isa_avx2_w16

const KernelTable kTableAvx2W16 = {
    "avx2_w16",
    16,
    isa_avx2_w16::kWinSlots,
    isa_avx2_w16::kWinRows,
    &isa_avx2_w16::decode_scratch,
    &isa_avx2_w16::window_scratch,
    &isa_avx2_w16::decode_item,
    &isa_avx2_w16::decode_combine,
    &isa_avx2_w16::window_pages,
};
const WindowFusedKernel kWindowFusedAvx2 = {&isa_avx2_w16::window_fused_scratch_fma,
                                            &isa_avx2_w16::window_fused_item_fma};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const KernelTable kTableAvx2W16 = {"avx2_w16", 0, 0, 0, nullptr, nullptr, nullptr, nullptr, nullptr};
const WindowFusedKernel kWindowFusedAvx2 = {nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
