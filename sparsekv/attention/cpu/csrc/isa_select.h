// Which kernel variants (KernelTable) this CPU runs; see isa_select.cpp.
#pragma once

#include <string>
#include <vector>

#include "kernels.h"

namespace sparsekv_cpu {

// Names of the variants this CPU runs, fastest first ("generic" always last).
std::vector<std::string> supported_isas();

// The table of variant `isa` if this CPU runs it, else nullptr.
const KernelTable* find_table(const std::string& isa);

// Why the AMX variant is or is not offered: "ok", or the missing feature or failed request.
std::string amx_status();

// Why the AVX512-BF16 kernels (prefill_bf16.h) can or cannot run here: "ok", or what is missing
// (AVX512-F, BW, DQ, VL and BF16 in CPUID).
std::string avx512_bf16_status();
// As avx512_bf16_status, also requiring AVX512-VNNI (the int8 Q·K^T prefill kernel).
std::string avx512_vnni_status();

// The x86 features the kernel variants depend on that this CPU has (CPUID), in a fixed order:
// avx2 fma avx512f avx512bw avx512dq avx512vl avx512_bf16 avx512_vnni amx_tile amx_bf16
// amx_int8 (AMX listed from CPUID alone: whether Linux grants it is amx_status()).
std::vector<std::string> cpu_features();

}  // namespace sparsekv_cpu
