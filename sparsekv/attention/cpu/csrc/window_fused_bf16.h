// Fused window scores and log-sum-exps with AVX512-BF16 dot products, for CPUs without AMX
// (included by isa_avx512_bf16.cpp after window_fused_passes.h; interface in window_fused.h).
//
// The AMX kernel's three passes (window_fused_amx.h) with pass 1 on vdpbf16ps: per block of 16
// keys and block of 16 rows, 16 accumulators (one per key, rows along the lanes) take, for each
// element pair e, the key's broadcast pair times the rows' pairs of e, and are stored to the
// logits buffer L[keys][rows] as the AMX tile store does. Logits are exact bf16 products summed
// in fp32 (in pair order: not the AMX tile's order, so the last bits may differ from it).

constexpr int64_t kBf16PrefetchBlocks = 4;  // key blocks fetched ahead, as the AMX kernel does

static int64_t window_fused_scratch_bf16(const WindowFusedArgs& a) {
  return 32 + a.rows * a.head_dim / 2 + a.num_blocks * 16 * a.rows + 8 * a.head_dim +
         4 * a.rows + 64;
}

// L[b * 16 + i][rb * 16 + c] = key i of block K (row stride `stride`) . row rb * 16 + c.
static inline void window_fused_dot_bf16(const uint16_t* K, int64_t stride, const uint32_t* qp,
                                         int64_t half, float* L, int64_t R) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t e = 0; e < half; ++e) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(qp + e * 16);
    for (int i = 0; i < 16; ++i) {
      uint32_t pair;
      __builtin_memcpy(&pair, K + i * stride + 2 * e, 4);
      acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32((int)pair), q);
    }
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(L + i * R, acc[i]);
}

// Logits of every key against every row into L[key][row] (keys past n: zero-key logits), and
// the rows' maxima into mx unless it is null.
static void window_fused_logits_bf16(const WindowFusedArgs& a, int64_t kvh, const uint32_t* qp,
                                     float* L, uint16_t* stage, const float* thr, float* mx) {
  const int64_t d = a.head_dim, half = d / 2, R = a.rows;
  for (int64_t b = 0; b < a.num_blocks; ++b) {
    const uint16_t* K = a.key_blocks[kvh * a.num_blocks + b];
    int64_t stride = a.key_row_stride;
    const int64_t nk = a.n - b * 16 < 16 ? a.n - b * 16 : 16;
    if (nk < 16) {  // the last, partial block: its rows past n may not be readable
      for (int64_t i = 0; i < nk; ++i) __builtin_memcpy(stage + i * d, K + i * stride, d * 2);
      __builtin_memset(stage + nk * d, 0, (16 - nk) * d * 2);
      K = stage;
      stride = d;
    }
    if (kvh * a.num_blocks + b + kBf16PrefetchBlocks < a.num_kv_heads * a.num_blocks) {
      const char* ahead = reinterpret_cast<const char*>(
          a.key_blocks[kvh * a.num_blocks + b + kBf16PrefetchBlocks]);
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t o = 0; o < d * 2; o += 64)
          __builtin_prefetch(ahead + i * a.key_row_stride * 2 + o, 0, 2);
    }
    for (int64_t rb = 0; rb < R / 16; ++rb)
      window_fused_dot_bf16(K, stride, qp + rb * half * 16, half, L + b * 16 * R + rb * 16, R);
    if (mx != nullptr) window_fused_block_max(a, b, L, thr, mx);
  }
}

// Scores and LSE of every query head of KV head kvh (WindowFusedKernel::item); the AMX item's
// steps with the logits above.
static void window_fused_item_bf16(const WindowFusedArgs& a, int64_t kvh, float* scratch) {
  const int64_t R = a.rows, d = a.head_dim;
  float* base = scratch + (16 - (reinterpret_cast<uintptr_t>(scratch) / 4) % 16) % 16;
  uint32_t* qp = reinterpret_cast<uint32_t*>(base + 16);
  float* L = base + 16 + R * d / 2;
  uint16_t* stage = reinterpret_cast<uint16_t*>(L + a.num_blocks * 16 * R);
  float* thr = L + a.num_blocks * 16 * R + 8 * d;
  float* lse_row = thr + R;
  float* inv_sum = lse_row + R;
  float* mx = inv_sum + R;
  const int64_t used = a.group * a.w;
  for (int64_t r = 0; r < R; ++r) {
    thr[r] = r < used ? (float)(a.n - a.w + r % a.w) : -1.0f;
    lse_row[r] = 0.0f;
    mx[r] = kNegInf;
    if (r < used && a.lse_in != nullptr)
      lse_row[r] = a.lse_in[(kvh * a.group + r / a.w) * a.w + r % a.w];
  }
  window_fused_pack_queries(a, kvh, qp);
  window_fused_logits_bf16(a, kvh, qp, L, stage, thr, a.lse_in == nullptr ? mx : nullptr);
  for (int64_t rb = 0; rb < R / 16; rb += 4) {
    const int count = R / 16 - rb < 4 ? (int)(R / 16 - rb) : 4;
    window_fused_softmax(a, rb, count, L, thr, mx, lse_row, inv_sum);
  }
  window_fused_columns(a, kvh, L, inv_sum);
  for (int64_t r = 0; r < used; ++r)
    a.lse_out[(kvh * a.group + r / a.w) * a.w + r % a.w] = lse_row[r];
}
