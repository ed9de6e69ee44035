// Prefetching of the chunk kernel's tiles (chunk_paged_impl.h; included there, inside the
// unit's namespace, after ChunkTile).
//
// Pages follow their block table, not address order, so the hardware cannot guess
// the next page, and one core has too few line fill buffers to fetch a whole tile by software
// prefetches at once (a burst stalls the core). As the AMX decode path (amx_util.h): two tiles
// ahead, the first line of each run of consecutive rows is touched so that the L2 streamer
// fetches the rest; one tile ahead, every line is prefetched a few at a time between the
// register blocks of the current tile.
struct ChunkLines {
  const char* run[2 * kChunkMaxTile];
  int64_t bytes[2 * kChunkMaxTile];
  int num_runs = 0, r = 0;
  int64_t offset = 0, per_step = 0;

  // The runs of tile t's key rows, then of its value rows, spread over `steps` calls of step().
  template <typename T>
  void start(const ChunkTile<T>& t, int64_t d, int64_t steps) {
    num_runs = r = 0;
    offset = 0;
    const int64_t row = d * (int64_t)sizeof(T);
    int64_t lines = 0;
    const char* run_end = nullptr;
    for (int kv = 0; kv < 2; ++kv)
      for (int64_t i = 0; i < t.n; ++i) {
        const char* p = (const char*)(kv ? t.v[i] : t.k[i]);
        if (i > 0 && p == run_end) {
          bytes[num_runs - 1] += row;
        } else {  // runs start at a line boundary, so their last line is not missed
          const int64_t skew = (int64_t)((uintptr_t)p % 64);
          run[num_runs] = p - skew;
          bytes[num_runs++] = row + skew;
        }
        run_end = p + row;
        lines += row / 64;
      }
    per_step = (lines + steps - 1) / (steps > 0 ? steps : 1);
  }
  void touch() const {
    for (int i = 0; i < num_runs; ++i) __builtin_prefetch(run[i]);
  }
  void step(int64_t lines) {
    // in registers, a run at a time: a few instructions per line between the register blocks
    int i = r;
    int64_t off = offset;
    while (lines > 0 && i < num_runs) {
      const char* p = run[i] + off;
      const int64_t left = (bytes[i] - off + 63) / 64, take = lines < left ? lines : left;
      for (int64_t l = 0; l < take; ++l) __builtin_prefetch(p + 64 * l);
      lines -= take;
      off += 64 * take;
      if (off >= bytes[i]) {
        ++i;
        off = 0;
      }
    }
    r = i;
    offset = off;
  }
  void step() { step(per_step); }
  void finish() { step(INT64_MAX); }
};
