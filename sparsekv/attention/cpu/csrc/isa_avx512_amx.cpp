// AVX-512 + AMX-BF16 kernels (16 fp32 lanes): bf16 decode attention, window scores (paged, and
// fused with their LSE) and causal prefill attention on AMX tiles (decode_amx.h, window_amx.h,
// window_fused_amx.h, prefill_amx.h); fp32 on the
// vector kernels, as in the AVX-512 unit.
//
// Listed by the binding only where CPUID shows AMX-TILE, AMX-BF16 and AVX512-BF16 and the
// kernel granted this process the tile state (arch_prctl), so other CPUs never run this code.
// <immintrin.h> is safe here, unlike standard-library headers (see kernels.h): its intrinsics
// are gnu_inline, never emitted out of line, so nothing of this unit can be merged into others.
#include <stdint.h>

#include "kernels.h"
#include "prefill.h"
#include "window_fused.h"

// AMX intrinsics need GCC 11 or newer; older compilers build the other variants only.
#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")
#include <immintrin.h>

namespace sparsekv_cpu {
namespace isa_avx512_amx {
#define SKV_W 16
#define SKV_AMX 1
#define SKV_AVX512 1
#include "kernel_impl.h"
#include "amx_util.h"
#include "decode_amx.h"
#include "window_amx.h"
#include "prefill_amx.h"
#include "window_fused_amx.h"
#undef SKV_AVX512
#undef SKV_AMX
#undef SKV_W
}  // namespace isa_avx512_amx

const KernelTable kTableAvx512Amx = {
    "avx512_amx",
    16,
    isa_avx512_amx::kWinSlots,
    isa_avx512_amx::kWinRows,
    &isa_avx512_amx::decode_scratch_amx,
    &isa_avx512_amx::window_scratch_amx,
    &isa_avx512_amx::decode_item_or_amx,
    &isa_avx512_amx::decode_combine,
    &isa_avx512_amx::window_pages_or_amx,
    true,
};
const PrefillKernel kPrefillAmx = {&isa_avx512_amx::prefill_scratch_amx,
                                   &isa_avx512_amx::prefill_item_amx};
const WindowFusedKernel kWindowFusedAmx = {&isa_avx512_amx::window_fused_scratch_amx,
                                           &isa_avx512_amx::window_fused_item_amx};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const KernelTable kTableAvx512Amx = {"avx512_amx", 0, 0, 0, nullptr, nullptr, nullptr, nullptr, nullptr};
const PrefillKernel kPrefillAmx = {nullptr, nullptr};
const WindowFusedKernel kWindowFusedAmx = {nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
