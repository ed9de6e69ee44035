// Runtime choice of the kernel variants: CPUID features and, for AMX, the kernel's grant.
// Compiled for the baseline ISA, like the binding: it runs before any variant is chosen.
#include "isa_select.h"

#include <cerrno>
#include <cstring>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace sparsekv_cpu {
namespace {

bool has_avx512() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

bool has_avx2_fma() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool has_fma() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// AMX-TILE, AMX-BF16, AVX512-BF16 and AVX512-BW in CPUID, and the tile state granted to this
// process: "ok" or why not. Linux enables AMX per process on request (arch_prctl
// ARCH_REQ_XCOMP_PERM; refused e.g. when a thread's signal stack is too small for the tile
// state); without the grant the first tile instruction kills the process (as llama.cpp's AMX
// build did on this VM). The grant is process-wide and permanent, so it is asked once.
const std::string& amx_check() {
  static const std::string status = []() -> std::string {
#if defined(__x86_64__) && defined(__linux__)
    if (!has_avx512() || !__builtin_cpu_supports("avx512bw")) return "no AVX-512 BW";
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return "no CPUID leaf 7";
    const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return "no CPUID leaf 7.1";
    const bool avx512_bf16 = (eax >> 5) & 1;
    if (!(amx_bf16 && amx_tile && avx512_bf16)) {  // name what is missing
      const bool present[] = {amx_bf16, amx_tile, avx512_bf16};
      const char* names[] = {"AMX-BF16", "AMX-TILE", "AVX512-BF16"};
      std::string missing;
      for (int i = 0; i < 3; ++i)
        if (!present[i]) missing += std::string(missing.empty() ? "no " : ", ") + names[i];
      return missing;
    }
    constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return "arch_prctl(ARCH_REQ_XCOMP_PERM) failed: " + std::string(std::strerror(errno));
    unsigned long long granted = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 ||
        !((granted >> kXfeatureXtiledata) & 1))
      return "tile state not granted";
    return "ok";
#else
    return "not x86-64 Linux";
#endif
  }();
  return status;
}

bool has_amx() { return amx_check() == "ok"; }

// CPUID leaf 7 (subleaf 0: ebx, ecx, edx; subleaf 1: eax), zeros where absent.
struct Leaf7 {
  unsigned ebx = 0, ecx = 0, edx = 0, eax1 = 0;
};

bool bit(unsigned word, int i) { return (word >> i) & 1; }

Leaf7 leaf7() {
  Leaf7 r;
#if defined(__x86_64__)
  unsigned eax, ebx, ecx, edx;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) {
    r.ebx = ebx;
    r.ecx = ecx;
    r.edx = edx;
    if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) r.eax1 = eax;
  }
#endif
  return r;
}

bool always() { return true; }

struct Variant {
  const char* name;
  const KernelTable* table;  // width 0: not compiled for this target
  bool (*cpu_runs)();
};

const Variant kVariants[] = {  // fastest first
    {"avx512_amx", &kTableAvx512Amx, has_amx},
    {"avx512", &kTableAvx512, has_avx512},
    {"avx2", &kTableAvx2, has_avx2_fma},
    // The 16-lane AVX-512 code built for AVX2: tests it on AVX2 CPUs (slower than avx2).
    {"avx2_w16", &kTableAvx2W16, has_avx2_fma},
    {"generic", &kTableGeneric, always},
};

}  // namespace

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const auto& v : kVariants)
    if (v.table->width > 0 && v.cpu_runs()) names.push_back(v.name);
  return names;
}

// Read once: the kernel bindings ask on every call, and CPUID traps to the hypervisor in a VM
// (~8 us each, four per read, measured on a cloud VM).
std::string avx512_bf16_status() {
  static const std::string status = []() -> std::string {
    const Leaf7 f = leaf7();
    if (!has_avx512()) return "no AVX-512F";
    // EBX bits 30 (BW), 17 (DQ), 31 (VL); leaf 7.1 EAX bit 5 (AVX512-BF16).
    if (!bit(f.ebx, 30) || !bit(f.ebx, 17) || !bit(f.ebx, 31)) return "no AVX-512 BW / DQ / VL";
    if (!bit(f.eax1, 5)) return "no AVX512-BF16";
    return "ok";
  }();
  return status;
}

// The AVX512-BF16 prefill with int8 Q·K^T needs AVX512-VNNI as well (leaf 7 ECX bit 11).
std::string avx512_vnni_status() {
  static const std::string status = []() -> std::string {
    const std::string bf16 = avx512_bf16_status();
    if (bf16 != "ok") return bf16;
    return bit(leaf7().ecx, 11) ? "ok" : "no AVX512-VNNI";
  }();
  return status;
}

std::vector<std::string> cpu_features() {
  const Leaf7 f = leaf7();
  const struct {
    const char* name;
    bool present;
  } flags[] = {
      {"avx2", bit(f.ebx, 5)},
      {"fma", has_fma()},
      {"avx512f", bit(f.ebx, 16)},
      {"avx512bw", bit(f.ebx, 30)},
      {"avx512dq", bit(f.ebx, 17)},
      {"avx512vl", bit(f.ebx, 31)},
      {"avx512_bf16", bit(f.eax1, 5)},
      {"avx512_vnni", bit(f.ecx, 11)},
      {"amx_tile", bit(f.edx, 24)},
      {"amx_bf16", bit(f.edx, 22)},
      {"amx_int8", bit(f.edx, 25)},
  };
  std::vector<std::string> names;
  for (const auto& flag : flags)
    if (flag.present) names.push_back(flag.name);
  return names;
}

std::string amx_status() {
  return kTableAvx512Amx.width > 0 ? amx_check() : "not compiled (needs GCC 11 or newer)";
}

const KernelTable* find_table(const std::string& isa) {
  for (const auto& v : kVariants)
    if (isa == v.name && v.table->width > 0 && v.cpu_runs()) return v.table;
  return nullptr;
}

}  // namespace sparsekv_cpu
