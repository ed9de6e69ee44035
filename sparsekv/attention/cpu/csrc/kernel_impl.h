// Paged decode attention and window scores, written once with GCC vector extensions.
//
// Included inside one namespace per ISA translation unit after `#define SKV_W <fp32 lanes>`;
// the unit's `#pragma GCC target` decides the instructions. No system header is included here
// (see kernels.h for why), so only builtins are used. Every function is static: each ISA unit
// keeps its own copy.
#include "vec_impl.h"
#include "decode_impl.h"
#include "combine_impl.h"
#include "window_impl.h"
