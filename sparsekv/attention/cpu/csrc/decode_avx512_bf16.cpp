// AVX-512 + AVX512-BF16 decode kernels (16 fp32 lanes) for CPUs without AMX: bf16 pools on
// vdpbf16ps dot products (decode_bf16.h); fp32, int8, fp8 and int4 pools and the window scores
// on the AVX-512 vector kernels (kernel_impl.h), as in the avx512 unit.
//
// Listed by the binding only where CPUID shows AVX512-F, BW, DQ, VL and BF16 (isa_select.cpp).
// <immintrin.h> is safe here, unlike standard-library headers (see kernels.h): its intrinsics
// are gnu_inline, never emitted out of line, so nothing of this unit can be merged into others.
#include <stdint.h>

#include "kernels.h"

// GCC 10 or later knows the avx512bf16 target; other compilers get the empty table below.
#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 10
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

namespace sparsekv_cpu {
namespace decode_avx512_bf16 {
#define SKV_W 16
#define SKV_AVX512 1
#define SKV_BF16_PAIRS 1
#include "kernel_impl.h"
#include "decode_bf16.h"
#undef SKV_BF16_PAIRS
#undef SKV_AVX512
#undef SKV_W
}  // namespace decode_avx512_bf16

const KernelTable kTableAvx512Bf16 = {
    "avx512_bf16",
    16,
    decode_avx512_bf16::kWinSlots,
    decode_avx512_bf16::kWinRows,
    &decode_avx512_bf16::decode_scratch_or_bf16,
    &decode_avx512_bf16::window_scratch,
    &decode_avx512_bf16::decode_item_or_bf16,
    &decode_avx512_bf16::decode_combine,
    &decode_avx512_bf16::window_pages,
};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const KernelTable kTableAvx512Bf16 = {"avx512_bf16", 0, 0, 0, nullptr, nullptr, nullptr, nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
