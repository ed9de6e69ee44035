// Portable packed-weight kernels (the compiler's baseline ISA; 8-lane vectors are split into
// its native width, 4 fp32 lanes on x86-64).
#include <stdint.h>

#include "quant.h"

namespace sparsekv_quant {
namespace isa_generic {
#include "quant_impl.h"
}  // namespace isa_generic

const QuantTable kQuantGeneric = {"generic", 4, &isa_generic::gemv, &isa_generic::gemm,
                                  &isa_generic::dequantize, 0, nullptr, nullptr};
}  // namespace sparsekv_quant
