// AVX-512 + AVX512-BF16 multi-query paged attention (16 fp32 lanes; chunk_paged_impl.h): bf16
// pages take vdpbf16ps dot products for both products (chunk_paged_bf16.h), fp32 pages and
// items of few rows the AVX-512F code.
#include <stdint.h>

#include "chunk_paged.h"

// GCC 10 or later knows the avx512bf16 target; other compilers get the empty kernel below.
#if defined(__x86_64__) && !defined(__clang__) && __GNUC__ >= 10
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>
namespace sparsekv_cpu {
namespace chunk_avx512_bf16 {
#define SKV_AVX512 1
#define SKV_W 16
#define SKV_CHUNK_BF16 1
#include "vec_impl.h"
#include "chunk_paged_impl.h"
#undef SKV_CHUNK_BF16
#undef SKV_W
#undef SKV_AVX512
}  // namespace chunk_avx512_bf16

const ChunkKernel kChunkAvx512Bf16 = {16, kChunkTileKeysBf16, &chunk_avx512_bf16::chunk_scratch,
                                      &chunk_avx512_bf16::chunk_item,
                                      &chunk_avx512_bf16::chunk_combine};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const ChunkKernel kChunkAvx512Bf16 = {0, 0, nullptr, nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
