// What the bf16- and int8-activation kernels of every variant share, without intrinsics: the
// result store, the scalars of the two-level int8 quantization of x (quant_q8_impl.h) and the
// sizes of an x16 group-block (quant.h). Included by isa_*.cpp inside its namespace, after
// quant.h.

static inline uint16_t round_bf16(float value) {
  uint32_t bits;
  __builtin_memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // nearest even
}

// y[r, col + i] <- value (+ bias[i]), rounded once to bf16 when y is bf16.
static inline void store_y(const MatmulArgs& a, int64_t r, int64_t i, float value) {
  if (a.bias) value += a.bias[i];
  const int64_t at = r * a.y_stride + a.col + i;
  if (a.y_bf16) {
    a.y_bf16[at] = round_bf16(value);
  } else {
    a.y[at] = value;
  }
}

// Blocks of x whose largest |value| is below 2^-100 quantize to zero: their unit would be
// subnormal (or 127 / max|x| overflow), and such a block adds below 2^-100 * sum |w| anyway.
constexpr float kTinyBlock = 7.8886091e-31f;

// A block of x the two-level quantization does not take: one holding a NaN or an infinity
// (`non_finite`, or max|x| beyond fp32) gets unit NaN, so the row's results are NaN as an fp32
// product's would be; one whose max|x| is below kTinyBlock counts as zero (127 / max|x| would
// overflow, or the unit be subnormal). Both get zero codes (high at `out`, residual at `out + k`)
// and a zero code sum. Returns false, writing nothing, for every other block.
static inline bool skip_x_block(bool non_finite, float amax, int8_t* out, int64_t k, float* unit,
                                int32_t* sum) {
  if (!non_finite && amax >= kTinyBlock && amax <= 3.4028235e38f) return false;
  __builtin_memset(out, 0, kBlock);
  __builtin_memset(out + k, 0, kBlock);
  *unit = non_finite || amax > 3.4028235e38f ? __builtin_nanf("") : 0.0f;
  *sum = 0;
  return true;
}

// Rows of x whose accumulators a small-M GEMM keeps on the stack at a time.
constexpr int64_t kPassRows = 64;

// The zero point the unsigned weight codes of the int8 kernels carry (Q4_0: 8, Q8_0 as q + 128:
// 128, Q4_1: 0), taken off each block's sum in int32.
template <int F>
constexpr int zero_point() {
  return F == kQ4_0 ? 8 : F == kQ8_0 ? 128 : 0;
}

// How far ahead the x16 kernels prefetch their weight stream. Decode reads every weight from
// memory once, in short calls (SmolLM2's 576 x 576 Q4_1 is 100 KiB per thread), and on a VM
// whose memory latency is ~250 ns the hardware prefetchers alone fall behind: a batch-1
// forward's 121 calls over weights evicted beforehand took 7.9-8.2 ms without, 6.6-6.8 ms with
// 16 KiB (2 cores, Emerald Rapids, alternating in one process; no gain while other tenants
// saturate the memory bus).
constexpr int64_t kWeightPrefetchBytes = 16384;

// Prefetches the cache lines kWeightPrefetchBytes past [p, p + bytes), stopping at `limit`
// (the end of this call's weight range: nothing beyond it is this thread's to read).
static inline void prefetch_weights_ahead(const uint8_t* p, int64_t bytes, const uint8_t* limit) {
  const int64_t left = limit - p;  // offsets, not pointers past the range
  const int64_t to = kWeightPrefetchBytes + bytes < left ? kWeightPrefetchBytes + bytes : left;
  for (int64_t at = kWeightPrefetchBytes; at < to; at += 64) __builtin_prefetch(p + at, 0, 3);
}

template <int F>
constexpr int x16_header_bytes() {  // 16 fp16 d, and Q4_1's 16 fp16 m
  return F == kQ4_1 ? 64 : 32;
}
template <int F>
constexpr int x16_code_vectors() {  // 64-byte code vectors per group-block
  return F == kQ8_0 ? 8 : 4;
}
template <int F>
constexpr int x16_group_block_bytes() {
  return x16_header_bytes<F>() + 64 * x16_code_vectors<F>();
}
