// Work-item threading shared by the torch bindings (not by the ISA units: see kernels.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace sparsekv_cpu {

// Below this many multiply-adds (~25 us on one core) a call runs on the calling thread: waking
// the pool costs more, and far more when other processes keep the cores busy. Decode steps keep
// the pool awake (the packed-weight linears between attention layers use every thread), so a
// batch-1 decode over a few hundred slots is split too.
constexpr int64_t kParallelMinWork = 1 << 19;

// Runs fn(item, scratch) for item in [0, num_items) on the intra-op threads; items are taken
// from a shared counter so uneven items balance.
template <typename F>
void run_dynamic(int64_t num_items, int64_t work, int64_t scratch_floats, const F& fn) {
  if (num_items == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t num_threads =
      work < kParallelMinWork ? 1 : std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(scratch_floats + 64);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
        fn(i, scratch.data());
  });
}

}  // namespace sparsekv_cpu
