// Portable kernels (4 fp32 lanes, baseline ISA of the compiler).
#include <stdint.h>

#include "kernels.h"

namespace sparsekv_cpu {
namespace isa_generic {
#define SKV_W 4
#include "kernel_impl.h"
#undef SKV_W
}  // namespace isa_generic

const KernelTable kTableGeneric = {
    "generic",
    4,
    isa_generic::kWinSlots,
    isa_generic::kWinRows,
    &isa_generic::decode_scratch,
    &isa_generic::window_scratch,
    &isa_generic::decode_item,
    &isa_generic::decode_combine,
    &isa_generic::window_pages,
};
}  // namespace sparsekv_cpu
