// Merge of a decode's split states (part of kernel_impl.h): flash-decoding splits of one
// (request, KV head), each an online-softmax state over its pages, are merged by their
// log-sum-exp; then the output, the lse and, if asked, the attention mass per held slot are
// written.

// Merge split states (base 2), write out, lse (natural log) and the attention mass. O is the
// output (query) type, T the pool's element type (its chunk order and CodeUnit).
template <typename O, typename T>
static void decode_combine_t(const DecodeArgs& a, int64_t b, int64_t kvh, const float* states,
                             int64_t num_splits, int64_t held_lo, int64_t held_hi,
                             float* scratch) {
  const int64_t G = a.num_heads / a.num_kv_heads, d = a.head_dim, st = d + 2;
  const int64_t sstride = G * st;
  O* out = static_cast<O*>(a.out) + (b * a.num_heads + kvh * G) * d;
  float* lse = a.lse + b * a.num_heads + kvh * G;
  float* acc = scratch;     // [d]
  float* lse2 = acc + d;    // [G] base-2 lse
  for (int64_t h = 0; h < G; ++h) {
    float M = kNegInf;
    for (int64_t s = 0; s < num_splits; ++s) {
      const float m = states[s * sstride + h * st];
      M = m > M ? m : M;
    }
    float L = 0.0f;
    for (int64_t e = 0; e < d; ++e) acc[e] = 0.0f;
    if (M != kNegInf) {
      for (int64_t s = 0; s < num_splits; ++s) {
        const float* sp = states + s * sstride + h * st;
        if (sp[0] == kNegInf) continue;
        const float w = __builtin_exp2f(sp[0] - M);
        L += sp[1] * w;
        for (int64_t e = 0; e < d; ++e) acc[e] += sp[2 + e] * w;
      }
    }
    // A request that sees no slot (nothing held) gets a zero output and lse = -inf.
    const float inv = L > 0.0f ? CodeUnit<T>::value / L : 0.0f;
    for (int64_t e = 0; e < d; ++e) from_float(acc[chunk_pos<T>(e)] * inv, out + h * d + e);
    lse2[h] = L > 0.0f ? M + __builtin_log2f(L) : kNegInf;
    lse[h] = lse2[h] * kLn2;
  }
  if (a.mass == nullptr || held_hi <= held_lo) return;
  float* mass = a.mass + (b * a.num_kv_heads + kvh) * a.held_cap;
  const float* scores = a.scores + (b * a.num_kv_heads + kvh) * G * a.held_cap;
  int64_t t = held_lo;
  for (; t + W <= held_hi; t += W) {
    vf m = splat(0.0f);
    for (int64_t h = 0; h < G; ++h)
      m += vexp2(loadu(scores + h * a.held_cap + t) - splat(lse2[h]));
    storeu(mass + t, m);
  }
  for (; t < held_hi; ++t) {
    float m = 0.0f;
    for (int64_t h = 0; h < G; ++h) m += __builtin_exp2f(scores[h * a.held_cap + t] - lse2[h]);
    mass[t] = m;
  }
}

static void decode_combine(const DecodeArgs& a, int64_t b, int64_t kvh, const float* states,
                           int64_t num_splits, int64_t held_lo, int64_t held_hi,
                           float* scratch) {
  using Combine = void (*)(const DecodeArgs&, int64_t, int64_t, const float*, int64_t, int64_t,
                           int64_t, float*);
  const bool q16 = a.query_bf16;
  Combine combine = decode_combine_t<float, float>;
  if (a.kv_type == kKvBFloat16)
    combine = decode_combine_t<uint16_t, uint16_t>;
  else if (a.kv_type == kKvInt8)
    combine = q16 ? decode_combine_t<uint16_t, int8_t> : decode_combine_t<float, int8_t>;
  else if (a.kv_type == kKvFp8E4M3)
    combine = q16 ? decode_combine_t<uint16_t, fp8_e4m3> : decode_combine_t<float, fp8_e4m3>;
  else if (a.kv_type == kKvInt4)
    combine = q16 ? decode_combine_t<uint16_t, int4x2> : decode_combine_t<float, int4x2>;
  combine(a, b, kvh, states, num_splits, held_lo, held_hi, scratch);
}
