// AVX-512 + AVX512-VNNI + AMX-INT8 packed-weight kernels: the avx512_vnni variant's kernels
// (isa_avx512_vnni.cpp), with the x16 GEMM on AMX tiles for 2 or more rows of x
// (quant_x16_amx_impl.h).
#include <stdint.h>

#include "quant.h"

// GCC 11 or later knows the amx-int8 target; other compilers get the empty table below.
#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")
// Intrinsics are gnu_inline, never emitted out of line: safe here, unlike standard-library
// headers (see quant.h).
#include <immintrin.h>
namespace sparsekv_quant {
namespace isa_avx512_amx {
#define QK_AVX2 1
#include "quant_impl.h"
#include "kernel_common_impl.h"
#include "small_m_impl.h"
#include "quant_q8_impl.h"
#include "quant_x16_impl.h"
#include "int8_rows_impl.h"
#include "quant_x16_amx_impl.h"
#undef QK_AVX2
}  // namespace isa_avx512_amx

const QuantTable kQuantAvx512Amx = {"avx512_amx",
                                    8,
                                    &isa_avx512_amx::gemv,
                                    &isa_avx512_amx::gemm,
                                    &isa_avx512_amx::dequantize,
                                    0,
                                    nullptr,
                                    nullptr,
                                    isa_avx512_amx::kQ8Formats,
                                    &isa_avx512_amx::quantize_x,
                                    &isa_avx512_amx::gemm_q8,
                                    &isa_avx512_amx::gemm_x16_amx,
                                    &isa_avx512_amx::quantize_rows,
                                    &isa_avx512_amx::scale_rows,
                                    &isa_avx512_amx::scale_rows_gated};
}  // namespace sparsekv_quant
#else
namespace sparsekv_quant {
const QuantTable kQuantAvx512Amx = {"avx512_amx", 0, nullptr, nullptr, nullptr,
                                    0,            nullptr, nullptr};
}  // namespace sparsekv_quant
#endif
