// Window scores (part of kernel_impl.h): out[h, j] = sum_i exp(q_i . k_j * scale - lse_i) over
// window rows i that see slot j. Key-major: each key row is broadcast against W window rows per vector, so no
// horizontal reduction is needed for the logits.

static int64_t window_scratch(const WindowArgs& a) {
  return kWinSlots * a.head_dim + kWinSlots * a.rows;
}

template <typename T>
static void window_page_t(const WindowArgs& a, int64_t kvh, int64_t pi, float* scratch) {
  const int64_t bs = a.block_size, d = a.head_dim, R = a.rows;
  const int64_t s_begin = pi * bs;
  const int64_t s_end = s_begin + bs < a.num_slots ? s_begin + bs : a.num_slots;
  const T* K = static_cast<const T*>(a.pool) + a.block_table[pi] * 2 * a.num_kv_heads * bs * d +
               kvh * bs * d;
  const float* qt = a.qt + kvh * d * R;
  const float* lse = a.lse + kvh * R;
  float* kf = scratch;              // [kWinSlots][d] fp32 key rows
  float* E = kf + kWinSlots * d;    // [kWinSlots][R] probabilities
  for (int64_t s0 = s_begin; s0 < s_end; s0 += kWinSlots) {
    const int64_t ns = s_end - s0 < kWinSlots ? s_end - s0 : kWinSlots;
    for (int64_t s = 0; s < kWinSlots; ++s)
      for (int64_t c = 0; c < d; ++c)
        kf[s * d + c] = s < ns ? to_float(K[(s0 - s_begin + s) * d + c]) : 0.0f;
    for (int64_t r0 = 0; r0 < R; r0 += kWinRows * W) {
      vf acc[kWinSlots][kWinRows];
      for (int s = 0; s < kWinSlots; ++s)
        for (int r = 0; r < kWinRows; ++r) acc[s][r] = splat(0.0f);
      for (int64_t c = 0; c < d; ++c) {
        vf qv[kWinRows];
        for (int r = 0; r < kWinRows; ++r) qv[r] = loadu(qt + c * R + r0 + r * W);
        for (int s = 0; s < kWinSlots; ++s) {
          const vf k = splat(kf[s * d + c]);
          for (int r = 0; r < kWinRows; ++r) acc[s][r] += k * qv[r];
        }
      }
      for (int s = 0; s < kWinSlots; ++s) {
        const vf slot = splat((float)(s0 + s));
        for (int r = 0; r < kWinRows; ++r) {
          const int64_t row = r0 + r * W;
          const vf e = vexp(acc[s][r] - loadu(lse + row));
          storeu(E + s * R + row, slot <= loadu(a.thr + row) ? e : splat(0.0f));
        }
      }
    }
    for (int64_t s = 0; s < ns; ++s)
      for (int64_t h = 0; h < a.group; ++h) {
        vf sum = splat(0.0f);
        const float* e = E + s * R + h * a.rows_per_head;
        for (int64_t i = 0; i < a.rows_per_head; i += W) sum += loadu(e + i);
        a.out[(kvh * a.group + h) * a.num_slots + s0 + s] = hsum(sum);
      }
  }
}

static void window_pages(const WindowArgs& a, int64_t kvh, int64_t page_begin,
                         int64_t page_end, float* scratch) {
  for (int64_t pi = page_begin; pi < page_end; ++pi) {
    if (a.is_bf16)
      window_page_t<uint16_t>(a, kvh, pi, scratch);
    else
      window_page_t<float>(a, kvh, pi, scratch);
  }
}
