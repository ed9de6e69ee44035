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

}  // namespace sparsekv_cpu
