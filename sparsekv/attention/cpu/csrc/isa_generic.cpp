// Portable kernels (4 fp32 lanes, baseline ISA of the compiler): decode attention, window
// scores (kernel_impl.h) and fp32 causal prefill attention (prefill_fma.h); and the portable
// fused window-score kernel (16 lanes, the width its passes are written for;
// window_fused_fma.h).
#include <stdint.h>

#include "kernels.h"
#include "prefill.h"
#include "window_fused.h"

namespace sparsekv_cpu {
namespace isa_generic {
#define SKV_W 4
#include "kernel_impl.h"
#include "prefill_fma.h"
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
const PrefillKernel kPrefillGeneric = {&isa_generic::prefill_scratch_fma,
                                       &isa_generic::prefill_item_fma};

namespace isa_generic_w16 {
#define SKV_W 16
#include "vec_impl.h"
#include "window_fused_passes.h"
#include "window_fused_fma.h"
#undef SKV_W
}  // namespace isa_generic_w16

const WindowFusedKernel kWindowFusedGeneric = {&isa_generic_w16::window_fused_scratch_fma,
                                               &isa_generic_w16::window_fused_item_fma};
}  // namespace sparsekv_cpu
