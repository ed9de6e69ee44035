// Portable multi-query paged attention (4 fp32 lanes, the compiler's baseline ISA;
// chunk_paged_impl.h).
#include <stdint.h>

#include "chunk_paged.h"

namespace sparsekv_cpu {
namespace chunk_generic {
#define SKV_W 4
#include "vec_impl.h"
#include "chunk_paged_impl.h"
#undef SKV_W
}  // namespace chunk_generic

const ChunkKernel kChunkGeneric = {4, 0, &chunk_generic::chunk_scratch, &chunk_generic::chunk_item,
                                   &chunk_generic::chunk_combine};
}  // namespace sparsekv_cpu
