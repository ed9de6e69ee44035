// Paged decode attention and window scores, written once with GCC vector extensions.
//
// Included inside one namespace per ISA translation unit after `#define SKV_W <fp32 lanes>`;
// the unit's `#pragma GCC target` decides the instructions. No system header is included here
// (see kernels.h for why), so only builtins are used, and the x86 intrinsics of <immintrin.h>
// where a unit includes it (before its namespace) and says so with SKV_AVX2 or SKV_AVX512:
// int4 code unpacking needs one (int4_impl.h). Every function is static: each ISA unit keeps
// its own copy.
#include "vec_impl.h"
#include "int4_impl.h"
#include "decode_impl.h"
#include "combine_impl.h"
#include "window_impl.h"
