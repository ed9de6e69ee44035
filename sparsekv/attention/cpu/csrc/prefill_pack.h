// K and V rearranged for the causal prefill kernels (the layouts of prefill.h), by the torch
// binding's threads: prefill_binding.cpp includes this once, inside its anonymous namespace.
// Needs ATen (at::Tensor, at::empty), run_items.h and prefill.h.

enum class Packing { kAmxTiles, kBf16Pairs, kFloat32 };

// Source K and V of the prefill kernel: [kvh, nk, d] bf16 bits with element stride 1 (or fp32:
// key_f32 and value_f32 set instead, same strides).
struct PrefillSource {
  const uint16_t* key;
  int64_t key_s0, key_s1;
  const uint16_t* value;
  int64_t value_s0, value_s1;
  int64_t nk, nkp, d;
  const float* key_f32;
  const float* value_f32;
};

// Keys [k0, k0 + kPrefillKeyBlock) of KV head h into the kernel's tiles (prefill.h): key rows
// copied 32 elements (64 bytes) at a time, value rows transposed; zero past nk.
void pack_prefill_block(const PrefillSource& s, int64_t h, int64_t k0, uint16_t* kp,
                        uint16_t* vt) {
  const int64_t d = s.d, chunks = d / 32;
  for (int64_t j = k0; j < k0 + skv::kPrefillKeyBlock; ++j) {
    const bool held = j < s.nk;
    const uint16_t* krow = s.key + h * s.key_s0 + j * s.key_s1;
    uint16_t* kdst = kp + ((h * (s.nkp / 16) + j / 16) * chunks) * 512 + j % 16 * 32;
    for (int64_t c = 0; c < chunks; ++c) {
      if (held)
        std::memcpy(kdst + c * 512, krow + c * 32, 64);
      else
        std::memset(kdst + c * 512, 0, 64);
    }
    const uint16_t* vrow = s.value + h * s.value_s0 + j * s.value_s1;
    uint16_t* vdst = vt + (h * (s.nkp / 32) + j / 32) * d * 32 + j % 32;
    for (int64_t e = 0; e < d; ++e) vdst[e * 32] = held ? vrow[e] : 0;
  }
}

// The same block for the AVX512-BF16 kernel (prefill.h): key rows as they are (unless kp is
// null: the int8 kernel quantizes them instead), the value rows of keys 2p and 2p + 1
// interleaved; zero past nk.
void pack_bf16_block(const PrefillSource& s, int64_t h, int64_t k0, uint16_t* kp, uint16_t* vp) {
  const int64_t d = s.d;
  for (int64_t j = k0; j < k0 + skv::kPrefillKeyBlock; ++j) {
    uint16_t* kdst = kp == nullptr ? nullptr : kp + (h * s.nkp + j) * d;
    uint16_t* vdst = vp + (h * s.nkp + j / 2 * 2) * d + j % 2;
    if (j >= s.nk) {
      if (kdst != nullptr) std::memset(kdst, 0, d * sizeof(uint16_t));
      for (int64_t e = 0; e < d; ++e) vdst[2 * e] = 0;
      continue;
    }
    if (kdst != nullptr)
      std::memcpy(kdst, s.key + h * s.key_s0 + j * s.key_s1, d * sizeof(uint16_t));
    const uint16_t* vrow = s.value + h * s.value_s0 + j * s.value_s1;
    for (int64_t e = 0; e < d; ++e) vdst[2 * e] = vrow[e];
  }
}

// The same block in fp32 for the FMA kernels (prefill.h): rows as they are; zero past nk.
void pack_f32_block(const PrefillSource& s, int64_t h, int64_t k0, float* kp, float* vp) {
  const int64_t d = s.d;
  for (int64_t j = k0; j < k0 + skv::kPrefillKeyBlock; ++j) {
    float* kdst = kp + (h * s.nkp + j) * d;
    float* vdst = vp + (h * s.nkp + j) * d;
    if (s.key_f32 != nullptr && j < s.nk) {
      std::memcpy(kdst, s.key_f32 + h * s.key_s0 + j * s.key_s1, d * sizeof(float));
      std::memcpy(vdst, s.value_f32 + h * s.value_s0 + j * s.value_s1, d * sizeof(float));
      continue;
    }
    if (j >= s.nk) {
      std::memset(kdst, 0, d * sizeof(float));
      std::memset(vdst, 0, d * sizeof(float));
      continue;
    }
    const uint16_t* krow = s.key + h * s.key_s0 + j * s.key_s1;
    const uint16_t* vrow = s.value + h * s.value_s0 + j * s.value_s1;
    for (int64_t e = 0; e < d; ++e) {
      const uint32_t kb = (uint32_t)krow[e] << 16, vb = (uint32_t)vrow[e] << 16;
      std::memcpy(kdst + e, &kb, 4);
      std::memcpy(vdst + e, &vb, 4);
    }
  }
}

// The keys of the int8 Q·K^T kernel (prefill.h): per KV head, the channel means, then the
// smoothed keys' codes and scales block by block, by the threads. Returns the buffers.
std::vector<at::Tensor> pack_key_codes(const at::Tensor& key, int64_t nkp,
                                       skv::PrefillArgs& args) {
  const int64_t kvh = key.size(0), nk = key.size(1), d = key.size(2);
  const skv::PrefillQk8Kernel& kernel = skv::kPrefillBf16Qk8;
  auto means = at::empty({kvh, d}, key.options().dtype(at::kFloat));
  auto codes = at::empty({kvh, nkp, d}, key.options().dtype(at::kByte));
  auto scales = at::empty({kvh, nkp}, key.options().dtype(at::kFloat));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(key.data_ptr());
  const int64_t s0 = key.stride(0), s1 = key.stride(1);
  float* mean = means.data_ptr<float>();
  run_dynamic(kvh, 2 * kvh * nk * d, 0, [&](int64_t h, float*) {
    kernel.key_means(src + h * s0, s1, nk, d, mean + h * d);
  });
  const int64_t blocks = nkp / skv::kPrefillKeyBlock;
  run_dynamic(kvh * blocks, 16 * kvh * nkp * d, 0, [&](int64_t i, float*) {
    const int64_t h = i / blocks, j0 = i % blocks * skv::kPrefillKeyBlock;
    kernel.quantize_keys(src + h * s0, s1, j0, j0 + skv::kPrefillKeyBlock, nk, d, mean + h * d,
                         codes.data_ptr<uint8_t>() + h * nkp * d,
                         scales.data_ptr<float>() + h * nkp);
  });
  args.key_codes = codes.data_ptr<uint8_t>();
  args.key_scales = scales.data_ptr<float>();
  args.key_means = mean;
  return {means, codes, scales};
}

// K and V rearranged as a kernel of `packing` takes them (prefill.h) into args, zero past nk, by the
// threads (one pass; PyTorch's pad + permute copies took ~1 ms on one thread at 4k tokens).
// Returns the buffers (kept alive by the caller).
// qk_int8: keys as int8 codes (pack_key_codes), values as for the AVX512-BF16 kernel.
std::vector<at::Tensor> pack_keys(Packing packing, const at::Tensor& key,
                                  const at::Tensor& value, bool qk_int8,
                                  skv::PrefillArgs& args) {
  const int64_t kvh = key.size(0), nk = key.size(1), d = key.size(2);
  const int64_t nkp = (nk + skv::kPrefillKeyBlock - 1) / skv::kPrefillKeyBlock *
                      skv::kPrefillKeyBlock;
  auto key_c = key.stride(2) == 1 ? key : key.contiguous();
  auto value_c = value.stride(2) == 1 ? value : value.contiguous();
  const bool f32 = packing == Packing::kFloat32;
  const bool f32_in = key.scalar_type() == at::kFloat;
  auto options = key.options().dtype(f32 ? at::kFloat : at::kBFloat16);
  auto kp = at::empty({qk_int8 ? 0 : kvh, nkp, d}, options);
  auto vp = at::empty({kvh, nkp, d}, options);
  const PrefillSource src{
      f32_in ? nullptr : reinterpret_cast<const uint16_t*>(key_c.data_ptr()),
      key_c.stride(0),
      key_c.stride(1),
      f32_in ? nullptr : reinterpret_cast<const uint16_t*>(value_c.data_ptr()),
      value_c.stride(0),
      value_c.stride(1),
      nk,
      nkp,
      d,
      f32_in ? key_c.data_ptr<float>() : nullptr,
      f32_in ? value_c.data_ptr<float>() : nullptr};
  const int64_t kv_blocks = nkp / skv::kPrefillKeyBlock;
  // (work: ~8 multiply-adds worth per element moved, by its time)
  run_dynamic(kvh * kv_blocks, 16 * kvh * nkp * d, 0, [&](int64_t i, float*) {
    const int64_t h = i / kv_blocks, k0 = i % kv_blocks * skv::kPrefillKeyBlock;
    if (packing == Packing::kAmxTiles)
      pack_prefill_block(src, h, k0, reinterpret_cast<uint16_t*>(kp.data_ptr()),
                         reinterpret_cast<uint16_t*>(vp.data_ptr()));
    else if (packing == Packing::kBf16Pairs)
      pack_bf16_block(src, h, k0, qk_int8 ? nullptr : reinterpret_cast<uint16_t*>(kp.data_ptr()),
                      reinterpret_cast<uint16_t*>(vp.data_ptr()));
    else
      pack_f32_block(src, h, k0, kp.data_ptr<float>(), vp.data_ptr<float>());
  });
  args.nkp = nkp;
  if (f32) {
    args.key_f32 = kp.data_ptr<float>();
    args.value_f32 = vp.data_ptr<float>();
  } else {
    args.key = reinterpret_cast<const uint16_t*>(kp.data_ptr());
    args.value_t = reinterpret_cast<const uint16_t*>(vp.data_ptr());
  }
  if (qk_int8) {
    auto held = pack_key_codes(key_c, nkp, args);
    held.push_back(vp);
    return held;
  }
  return {kp, vp};
}
