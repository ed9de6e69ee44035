// Fused window scores and log-sum-exps with fp32 FMAs, for CPUs with neither AMX nor AVX512-BF16
// (included after window_fused_passes.h by isa_avx2_w16.cpp, AVX2 + FMA, and by
// isa_generic.cpp, the compiler's baseline ISA; interface in window_fused.h).
//
// The AMX kernel's three passes (window_fused_amx.h) with pass 1 on fp32 FMAs: a block of 16
// keys is widened to fp32 once into a stage (an L1-resident 16 x head_dim buffer), the rows'
// queries once per item into fp32 columns qf[row block][element][16 rows]; then for 4 keys at a
// time and each row block, native-width accumulators (rows along the lanes; two 8-lane ones per
// 16 rows on AVX2, four 4-lane ones on SSE / NEON) take the key's broadcast element times the
// rows' column of that element, and are stored to the logits buffer L[keys][rows] as the AMX
// tile store does. Pass 2 (softmax, row maxima) also runs on native-width vectors here, with
// the same per-lane operations as window_fused_passes.h's; pass 3 is that file's. Keys and queries are both widened in the order load2 reads bf16 (even elements of a
// 32-element chunk, then odd ones): the dot product is the same sum in another order. Logits
// are exact bf16 products (16 significant bits fit fp32's 24) summed in fp32 in one fixed order
// per (key, row), so the dense and paged calls give the same bits. fp32 keys and queries
// (key_blocks_f32, query_f32) are staged as they are, in their own element order; their
// logits are fp32 dot products, summed in the same fixed order per (key, row).

// Element e's position in the staged rows: load2's order for bf16, the row's own for fp32.
static inline int64_t window_fused_fma_pos(const WindowFusedArgs& a, int64_t e) {
  if (a.query_f32 != nullptr) return e;
  const int64_t base = e - e % 32, r = e % 32;
  return base + ((r & 1) ? 16 + (r >> 1) : (r >> 1));
}

constexpr int64_t kFmaPrefetchBlocks = 4;  // key blocks fetched ahead, as the AMX kernel does
constexpr int64_t kFmaKeys = 4;            // keys per register block (x 16 rows)

static int64_t window_fused_scratch_fma(const WindowFusedArgs& a) {
  return 32 + a.rows * a.head_dim + a.num_blocks * 16 * a.rows + 16 * a.head_dim + 4 * a.rows +
         64;
}

// qf[(rb * head_dim + p) * 16 + c] = element at position p of row rb * 16 + c (0 for padding).
static void window_fused_pack_queries_fma(const WindowFusedArgs& a, int64_t kvh, float* qf) {
  const int64_t d = a.head_dim, used = a.group * a.w;
  for (int64_t rb = 0; rb < a.rows / 16; ++rb)
    for (int64_t c = 0; c < 16; ++c) {
      const int64_t row = rb * 16 + c;
      const int64_t at = (kvh * a.group + row / a.w) * a.query_head_stride +
                         (row % a.w) * a.query_row_stride;
      for (int64_t e = 0; e < d; ++e) {
        float x = 0.0f;
        if (row < used)
          x = a.query_f32 != nullptr ? a.query_f32[at + e] : to_float(a.query[at + e]);
        qf[(rb * d + window_fused_fma_pos(a, e)) * 16 + c] = x;
      }
    }
}

// The 16 key rows of block K (nk readable, the rest zero) widened to fp32 into kf[16][d].
static inline void window_fused_widen_keys(const uint16_t* K, int64_t stride, int64_t nk,
                                           int64_t d, float* kf) {
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t ch = 0; ch < d; ch += 32) {
      vf even = splat(0.0f), odd = splat(0.0f);
      if (i < nk) load2(K + i * stride + ch, even, odd);
      storeu(kf + i * d + ch, even);
      storeu(kf + i * d + ch + 16, odd);
    }
}

// The same for fp32 key rows: copied as they are.
static inline void window_fused_stage_keys(const float* K, int64_t stride, int64_t nk, int64_t d,
                                           float* kf) {
  for (int64_t i = 0; i < 16; ++i)
    for (int64_t e = 0; e < d; e += W)
      storeu(kf + i * d + e, i < nk ? loadu(K + i * stride + e) : splat(0.0f));
}

// The hot loops of passes 1 and 2 run on native-width vectors (kFmaLanes lanes, kFmaGroups of
// them per 16 rows). The passes' 16-lane vf is two AVX2 registers (four SSE / NEON ones): GCC
// 12 moves arrays of it through the stack around every FMA, and lowers its comparisons and
// selects to scalar code lane by lane, which left these loops at a tenth of their rate.
#if defined(SKV_AVX2)
#define SKV_FMA_LANES 8
#else
#define SKV_FMA_LANES 4
#endif
typedef float vn __attribute__((vector_size(SKV_FMA_LANES * 4)));
typedef int32_t vni __attribute__((vector_size(SKV_FMA_LANES * 4)));
constexpr int kFmaLanes = SKV_FMA_LANES;
#undef SKV_FMA_LANES
constexpr int kFmaGroups = 16 / kFmaLanes;  // lane groups of a 16-row block
// Lane groups per register block: 2 x kFmaKeys accumulators, the query vectors and a
// broadcast fit AVX2's 16 registers (x86-64 SSE's too).
constexpr int kFmaGroupsAtOnce = 2;

static inline vn load_native(const float* p) {
  vn v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
static inline void store_native(float* p, vn v) { __builtin_memcpy(p, &v, sizeof(v)); }

// L[(b * 16 + i) * R + rb * 16 + c] = widened key i . row rb * 16 + c, for i in i0 .. i0 + 3:
// every (key, row) dot product in one fixed order (p = 0 .. d - 1), as before the split.
static inline void window_fused_dot_fma(const float* kf, const float* qf, int64_t d, float* L,
                                        int64_t R) {
  for (int g0 = 0; g0 < kFmaGroups; g0 += kFmaGroupsAtOnce) {
    vn acc[kFmaKeys][kFmaGroupsAtOnce];
    for (int t = 0; t < kFmaKeys; ++t)
      for (int g = 0; g < kFmaGroupsAtOnce; ++g) acc[t][g] = vn{};
    for (int64_t p = 0; p < d; ++p) {
      vn q[kFmaGroupsAtOnce];
      for (int g = 0; g < kFmaGroupsAtOnce; ++g)
        q[g] = load_native(qf + p * 16 + (g0 + g) * kFmaLanes);
#pragma GCC unroll 4
      for (int t = 0; t < kFmaKeys; ++t) {
        const vn k = kf[t * d + p] - vn{};  // broadcast
        for (int g = 0; g < kFmaGroupsAtOnce; ++g) acc[t][g] += k * q[g];
      }
    }
    for (int t = 0; t < kFmaKeys; ++t)
      for (int g = 0; g < kFmaGroupsAtOnce; ++g)
        store_native(L + t * R + (g0 + g) * kFmaLanes, acc[t][g]);
  }
}

// window_fused_block_max on native-width vectors: the same maxima, reduced in the same tree.
static void window_fused_block_max_fma(const WindowFusedArgs& a, int64_t b, const float* L,
                                       const float* thr, float* mx) {
  const int64_t R = a.rows;
  const bool all_seen = b * 16 + 15 <= a.n - a.w;  // the first window row sees slot n - w
  for (int64_t g = 0; g < R / kFmaLanes; ++g) {
    const vn last = load_native(thr + g * kFmaLanes);
    vn v[16];
    for (int i = 0; i < 16; ++i) {
      v[i] = load_native(L + (b * 16 + i) * R + g * kFmaLanes);
      if (!all_seen) v[i] = (float)(b * 16 + i) - vn{} <= last ? v[i] : kNegInf - vn{};
    }
    for (int s = 8; s > 0; s /= 2)
      for (int i = 0; i < s; ++i) v[i] = v[i] > v[i + s] ? v[i] : v[i + s];
    const vn old = load_native(mx + g * kFmaLanes);
    store_native(mx + g * kFmaLanes, old > v[0] ? old : v[0]);
  }
}

// window_fused_softmax for row block rb on native-width vectors: the same terms, sums and
// finishing step (window_fused_passes.h explains the shift and the cap at 1).
static void window_fused_softmax_fma(const WindowFusedArgs& a, int64_t rb, float* L,
                                     const float* thr, const float* mx, float* lse_row,
                                     float* inv_sum) {
  const int64_t R = a.rows, keys = a.num_blocks * 16, off = rb * 16;
  const vn qscale = a.scale * kLog2e - vn{}, one = 1.0f - vn{};
  vn last[kFmaGroups], shift[kFmaGroups], sum[kFmaGroups];
  for (int g = 0; g < kFmaGroups; ++g) {
    const int64_t at = off + g * kFmaLanes;
    last[g] = load_native(thr + at);
    shift[g] = a.lse_in != nullptr ? load_native(lse_row + at) / (a.scale - vn{})
               : last[g] >= vn{}   ? load_native(mx + at)
                                   : vn{};
    sum[g] = vn{};
  }
  const int64_t unmasked = a.group * a.w == R ? a.n - a.w + 1 : 0;
  for (int64_t j = 0; j < unmasked; ++j)
    for (int g = 0; g < kFmaGroups; ++g) {
      float* p = L + j * R + off + g * kFmaLanes;
      vn e = vexp2_lanes<vn, vni>((load_native(p) - shift[g]) * qscale);
      e = one < e ? one : e;  // vmin(e, 1): a NaN e stays NaN
      store_native(p, e);
      sum[g] += e;
    }
  for (int64_t j = unmasked; j < keys; ++j) {
    const vn key = (float)j - vn{};
    for (int g = 0; g < kFmaGroups; ++g) {
      float* p = L + j * R + off + g * kFmaLanes;
      vn e = vexp2_lanes<vn, vni>((load_native(p) - shift[g]) * qscale);
      e = one < e ? one : e;
      const vn kept = key <= last[g] ? e : vn{};
      store_native(p, kept);
      sum[g] += kept;
    }
  }
  float s[16], sh[16];
  __builtin_memcpy(s, sum, sizeof(s));
  __builtin_memcpy(sh, shift, sizeof(sh));
  window_fused_finish_rows(a, off, s, sh, thr, lse_row, inv_sum);
}

// Logits of every key against every row into L[key][row] (keys past n: zero-key logits), and
// the rows' maxima into mx unless it is null.
static void window_fused_logits_fma(const WindowFusedArgs& a, int64_t kvh, const float* qf,
                                    float* L, float* kf, const float* thr, float* mx) {
  const int64_t d = a.head_dim, R = a.rows;
  const bool f32 = a.key_blocks_f32 != nullptr;
  for (int64_t b = 0; b < a.num_blocks; ++b) {
    const int64_t nk = a.n - b * 16 < 16 ? a.n - b * 16 : 16, block = kvh * a.num_blocks + b;
    const int64_t bytes = f32 ? 4 : 2;  // per element
    if (block + kFmaPrefetchBlocks < a.num_kv_heads * a.num_blocks) {
      const char* ahead =
          f32 ? reinterpret_cast<const char*>(a.key_blocks_f32[block + kFmaPrefetchBlocks])
              : reinterpret_cast<const char*>(a.key_blocks[block + kFmaPrefetchBlocks]);
      for (int64_t i = 0; i < 16; ++i)
        for (int64_t o = 0; o < d * bytes; o += 64)
          __builtin_prefetch(ahead + i * a.key_row_stride * bytes + o, 0, 2);
    }
    if (f32)
      window_fused_stage_keys(a.key_blocks_f32[block], a.key_row_stride, nk, d, kf);
    else
      window_fused_widen_keys(a.key_blocks[block], a.key_row_stride, nk, d, kf);
    for (int64_t rb = 0; rb < R / 16; ++rb)
      for (int64_t i = 0; i < 16; i += kFmaKeys)
        window_fused_dot_fma(kf + i * d, qf + rb * d * 16, d, L + (b * 16 + i) * R + rb * 16, R);
    if (mx != nullptr) window_fused_block_max_fma(a, b, L, thr, mx);
  }
}

// Scores and LSE of every query head of KV head kvh (WindowFusedKernel::item); the AMX item's
// steps with the logits above.
static void window_fused_item_fma(const WindowFusedArgs& a, int64_t kvh, float* scratch) {
  const int64_t R = a.rows, d = a.head_dim;
  float* base = scratch + (16 - (reinterpret_cast<uintptr_t>(scratch) / 4) % 16) % 16;
  float* qf = base + 16;
  float* L = qf + R * d;
  float* kf = L + a.num_blocks * 16 * R;
  float* thr = kf + 16 * d;
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
  window_fused_pack_queries_fma(a, kvh, qf);
  window_fused_logits_fma(a, kvh, qf, L, kf, thr, a.lse_in == nullptr ? mx : nullptr);
  for (int64_t rb = 0; rb < R / 16; ++rb)
    window_fused_softmax_fma(a, rb, L, thr, mx, lse_row, inv_sum);
  window_fused_columns(a, kvh, L, inv_sum);
  for (int64_t r = 0; r < used; ++r)
    a.lse_out[(kvh * a.group + r / a.w) * a.w + r % a.w] = lse_row[r];
}
