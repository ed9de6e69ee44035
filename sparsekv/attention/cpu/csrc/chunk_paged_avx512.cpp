// AVX-512F multi-query paged attention (16 fp32 lanes; chunk_paged_impl.h): the same template
// as the AVX2 unit at twice the width.
#include <stdint.h>

#include "chunk_paged.h"

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx2,fma,f16c")
#include <immintrin.h>
namespace sparsekv_cpu {
namespace chunk_avx512 {
#define SKV_AVX512 1
#define SKV_W 16
#include "vec_impl.h"
#include "chunk_paged_impl.h"
#undef SKV_W
#undef SKV_AVX512
}  // namespace chunk_avx512

const ChunkKernel kChunkAvx512 = {16, 0, &chunk_avx512::chunk_scratch, &chunk_avx512::chunk_item,
                                  &chunk_avx512::chunk_combine};
}  // namespace sparsekv_cpu
#else
namespace sparsekv_cpu {
const ChunkKernel kChunkAvx512 = {0, 0, nullptr, nullptr, nullptr};
}  // namespace sparsekv_cpu
#endif
