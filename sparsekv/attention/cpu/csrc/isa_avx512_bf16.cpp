// AVX-512 + AVX512-BF16 kernels (16 fp32 lanes) for CPUs without AMX: causal prefill attention
// and fused window scores with vdpbf16ps dot products (prefill_bf16.h, window_fused_bf16.h),
// and the prefill with int8 Q·K^T by AVX512-VNNI (prefill_qk8.h). The decode kernels of these
// CPUs are the AVX-512F ones (isa_avx512.cpp): their bf16 rows are unpacked to fp32 anyway.
//
// Used by the binding only where CPUID shows AVX512-F, BW, DQ, VL and BF16, and the int8 kernel
// only with AVX512-VNNI too (isa_select.cpp). Its one VNNI instruction is inline asm, so the
// unit's target leaves VNNI out: nothing else here can use it.
// <immintrin.h> is safe here, unlike standard-library headers (see kernels.h): its intrinsics
// are gnu_inline, never emitted out of line, so nothing of this unit can be merged into others.
#include <stdint.h>

#include "prefill.h"
#include "window_fused.h"

#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 10
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

namespace sparsekv_cpu {
namespace isa_avx512_bf16 {
#define SKV_W 16
#define SKV_AVX512 1
#include "vec_impl.h"
struct TileConfig;  // prefill_softmax.h's scratch carves room for one; no tile is used here
#include "prefill_softmax.h"
#include "prefill_bf16.h"
#include "prefill_qk8.h"
#include "window_fused_passes.h"
#include "window_fused_bf16.h"
#undef SKV_AVX512
#undef SKV_W
}  // namespace isa_avx512_bf16

const PrefillKernel kPrefillBf16 = {&isa_avx512_bf16::prefill_scratch_bf16,
                                    &isa_avx512_bf16::prefill_item_bf16};
const PrefillQk8Kernel kPrefillBf16Qk8 = {
    &isa_avx512_bf16::prefill_scratch_bf16, &isa_avx512_bf16::prefill_item_qk8,
    &isa_avx512_bf16::key_means_qk8, &isa_avx512_bf16::quantize_keys_qk8};
const WindowFusedKernel kWindowFusedBf16 = {&isa_avx512_bf16::window_fused_scratch_bf16,
                                            &isa_avx512_bf16::window_fused_item_bf16};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const PrefillKernel kPrefillBf16 = {nullptr, nullptr};
const PrefillQk8Kernel kPrefillBf16Qk8 = {nullptr, nullptr, nullptr, nullptr};
const WindowFusedKernel kWindowFusedBf16 = {nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
