// AVX-512 + AMX-BF16 multi-query paged attention (16 fp32 lanes; chunk_paged_impl.h): items of
// bf16 pages with up to kAmxChunkCols columns run on tiles (chunk_paged_amx.h), wider ones on
// the AVX512-BF16 path, fp32 pages on the AVX-512F code.
//
// Listed by the binding only where the CPU runs the AMX decode variant (CPUID and the kernel's
// grant of the tile state), so other CPUs never run this code.
#include <stdint.h>

#include "chunk_paged.h"

// AMX intrinsics need GCC 11 or newer; other compilers get the empty kernel below.
#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")
#include <immintrin.h>
namespace sparsekv_cpu {
namespace chunk_avx512_amx {
#define SKV_AVX512 1
#define SKV_W 16
#define SKV_CHUNK_BF16 1
#define SKV_CHUNK_AMX 1
#include "vec_impl.h"
#include "chunk_paged_impl.h"
#undef SKV_CHUNK_AMX
#undef SKV_CHUNK_BF16
#undef SKV_W
#undef SKV_AVX512
}  // namespace chunk_avx512_amx

const ChunkKernel kChunkAvx512Amx = {16, kChunkTileKeysBf16, &chunk_avx512_amx::chunk_scratch,
                                     &chunk_avx512_amx::chunk_item,
                                     &chunk_avx512_amx::chunk_combine};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const ChunkKernel kChunkAvx512Amx = {0, 0, nullptr, nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
