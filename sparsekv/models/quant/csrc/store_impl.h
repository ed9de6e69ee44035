// The result store shared by the bf16- and int8-activation kernels (quant_bf16_impl.h,
// quant_q8_impl.h); included by their isa_*.cpp inside its namespace, after quant.h.

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
