// AVX2 + FMA multi-query paged attention (8 fp32 lanes; chunk_paged_impl.h).
#include <stdint.h>

#include "chunk_paged.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
namespace sparsekv_cpu {
namespace chunk_avx2 {
#define SKV_AVX2 1
#define SKV_W 8
#include "vec_impl.h"
#include "chunk_paged_impl.h"
#undef SKV_W
#undef SKV_AVX2
}  // namespace chunk_avx2

const ChunkKernel kChunkAvx2 = {8, 0, &chunk_avx2::chunk_scratch, &chunk_avx2::chunk_item,
                                &chunk_avx2::chunk_combine};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const ChunkKernel kChunkAvx2 = {0, 0, nullptr, nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
