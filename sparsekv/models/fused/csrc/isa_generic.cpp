// Portable row kernels (4 fp32 lanes, the compiler's baseline ISA).
#include <stdint.h>

#include "fused.h"

namespace sparsekv_fused {
namespace isa_generic {
#define FK_W 4
#include "fused_impl.h"
#undef FK_W
}  // namespace isa_generic

const FusedTable kTableGeneric = {
    "generic",
    4,
    &isa_generic::rms_norm,
    &isa_generic::silu_mul,
    &isa_generic::gelu_tanh_mul,
    &isa_generic::rotary,
};
}  // namespace sparsekv_fused
