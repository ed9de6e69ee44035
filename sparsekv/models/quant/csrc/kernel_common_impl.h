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

// The zero point the unsigned weight codes of the int8 kernels carry (Q4_0: 8, Q8_0 as q + 128:
// 128, Q4_1: 0), taken off each block's sum in int32.
template <int F>
constexpr int zero_point() {
  return F == kQ4_0 ? 8 : F == kQ8_0 ? 128 : 0;
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
