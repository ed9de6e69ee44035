"""KV-cache quantization: format error bounds, page storage semantics, attention over
quantized pages, page kinds of the pool, and config errors.

Error bounds per element (x a row of head_dim values, or for int4 keys a channel over a page):
int8 ``|err| <= absmax / 254``; fp8 ``|err| <= max(2^-4 |x|, 2^-10 scale)`` (3 mantissa bits,
subnormal spacing 2^-9 scale); int4 ``|err| <= 0.5 scale`` plus the fp16 rounding of scale and
zero.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.backends import DecodeParams
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.attention.torch_ref import attention_with_lse
from sparsekv.config import CacheConfig
from sparsekv.kv_cache import quant
from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.manager import KVCacheManager, KVPolicy
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.kv_cache.storage import make_storage, page_bytes

KVH, BS, D = 3, 16, 64
FORMATS = ("auto", "int8", "fp8", "int4")


def activations(shape, seed=0, outlier_channels=(3, 17)) -> torch.Tensor:
    """Gaussian K/V with a few large channels, as real keys have."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., list(outlier_channels)] *= 8.0
    return x


# ----------------------------------------------------------------- format error bounds
def test_int8_error_bound():
    x = activations((50, KVH, D))
    codes, scale = quant.quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == (50, KVH)
    err = (quant.dequantize_int8(codes, scale, torch.float32) - x).abs()
    bound = x.abs().amax(-1, keepdim=True) / 254
    assert (err <= bound * (1 + 1e-5) + 1e-7).all()
    assert codes.abs().max() == 127  # the absmax maps to the top code


def test_fp8_error_bound():
    x = activations((50, KVH, D), seed=1)
    codes, scale = quant.quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn
    err = (quant.dequantize_fp8(codes, scale, torch.float32) - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, scale[..., None] * 2.0**-10)
    assert (err <= bound * (1 + 1e-5)).all()


def test_int4_keys_per_channel_and_values_per_token():
    x = activations((4, KVH, BS, D), seed=2)
    packed, scale, zero = quant.quantize_int4_keys(x)
    assert packed.shape == (4, KVH, BS, D // 2) and scale.shape == (4, KVH, D)
    err = (quant.dequantize_int4_keys(packed, scale, zero, torch.float32) - x).abs()
    span = x.amax(-2) - x.amin(-2)  # per channel over the page's slots
    assert (err <= (span / 30 + span * 2e-3 + 1e-4)[..., None, :]).all()
    packed, scale, zero = quant.quantize_int4_values(x)
    assert packed.shape == (4, KVH, BS, D // 2) and scale.shape == (4, KVH, BS)
    err = (quant.dequantize_int4_values(packed, scale, zero, torch.float32) - x).abs()
    span = x.amax(-1) - x.amin(-1)  # per token over head_dim
    assert (err <= (span / 30 + span * 2e-3 + 1e-4)[..., None]).all()


def test_int4_pack_round_trip():
    codes = torch.randint(0, 16, (5, 8))
    assert torch.equal(quant.unpack_int4(quant.pack_int4(codes)), codes.to(torch.uint8))


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    """KIVI's reason for per-channel keys: outlier channels ruin a per-token range."""
    x = activations((8, KVH, BS, D), seed=3)
    per_channel = quant.dequantize_int4_keys(*quant.quantize_int4_keys(x), torch.float32)
    per_token = quant.dequantize_int4_values(*quant.quantize_int4_values(x), torch.float32)
    assert (per_channel - x).norm() < 0.6 * (per_token - x).norm()


# ----------------------------------------------------------------- storage semantics
def storage(fmt, num_pages=16, offset=0):
    return make_storage(fmt, num_pages, offset, KVH, BS, D, torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_page_bytes_match_the_tensors(fmt):
    assert storage(fmt).page_bytes == page_bytes(fmt, KVH, BS, D, torch.float32)


def test_page_bytes_per_format():
    sizes = {fmt: page_bytes(fmt, KVH, BS, D, torch.bfloat16) for fmt in FORMATS}
    assert sizes == {"auto": 12288, "int8": 6528, "fp8": 6528, "int4": 4032}


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_scaled_gather_is_the_dequantized_write(fmt):
    store, state = storage(fmt), LayerKV()
    table = [5, 2, 9]
    key, value = activations((KVH, 40, D), 4), activations((KVH, 40, D), 5)
    store.write_slots(state, table, 0, key[:, :23], value[:, :23])
    store.write_slots(state, table, 23, key[:, 23:], value[:, 23:])
    keys, values = store.gather(state, table, 40)
    quantize = quant.quantize_int8 if fmt == "int8" else quant.quantize_fp8
    dequantize = quant.dequantize_int8 if fmt == "int8" else quant.dequantize_fp8
    assert torch.equal(keys, dequantize(*quantize(key), torch.float32))
    assert torch.equal(values, dequantize(*quantize(value), torch.float32))


def test_int4_full_pages_quantized_residual_exact():
    store, state = storage("int4"), LayerKV()
    table = [7, 1, 4]
    key, value = activations((KVH, 37, D), 6), activations((KVH, 37, D), 7)
    for t in range(37):  # one token at a time, as decode writes
        store.write_slots(state, table, t, key[:, t : t + 1], value[:, t : t + 1])
        state.num_slots = t + 1
    assert state.residual[0].shape == (KVH, 37 % BS, D)
    keys, values = store.gather(state, table, 37)
    assert torch.equal(keys[:, 32:], key[:, 32:])  # the residual is full precision
    pages = key[:, :32].reshape(KVH, 2, BS, D).transpose(0, 1)
    expected = quant.dequantize_int4_keys(*quant.quantize_int4_keys(pages), torch.float32)
    assert torch.equal(keys[:, :32], expected.transpose(0, 1).reshape(KVH, 32, D))
    # Bulk writing gives the same pages and residual.
    bulk_store, bulk_state = storage("int4"), LayerKV()
    bulk_store.write_slots(bulk_state, table, 0, key, value)
    bulk_keys, bulk_values = bulk_store.gather(bulk_state, table, 37)
    assert torch.equal(bulk_keys, keys) and torch.equal(bulk_values, values)


def test_int4_write_leading_resets_the_residual():
    store, state = storage("int4"), LayerKV()
    key = activations((KVH, 20, D), 8)
    store.write_slots(state, [0, 1], 0, key, key)
    store.write_leading(state, [3], key[:, :10], key[:, :10])
    assert state.residual[0].shape[1] == 10
    keys, _ = store.gather(state, [3], 10)
    assert torch.equal(keys, key[:, :10])


@pytest.mark.parametrize("fmt", FORMATS)
def test_read_write_pages_is_bit_exact(fmt):
    store, state = storage(fmt), LayerKV()
    key = activations((KVH, 48, D), 9)
    store.write_slots(state, [3, 4, 5], 0, key, key * 0.5)
    copy = store.read_pages([3, 4, 5])
    before = store.gather(state, [3, 4, 5], 48)
    other = storage(fmt)
    other.write_pages([10, 0, 2], copy)
    after = other.gather(state, [10, 0, 2], 48)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_page_offset_maps_global_ids():
    store, state = storage("int8", num_pages=4, offset=100), LayerKV()
    key = activations((KVH, 20, D), 10)
    store.write_slots(state, [102, 100], 0, key, key)
    assert store.codes[2].abs().sum() > 0 and store.codes[1].abs().sum() == 0
    keys, _ = store.gather(state, [102, 100], 20)
    assert (keys - key).abs().max() < key.abs().max() / 100


# ----------------------------------------------------------------- attention over pages
# Relative L2 error of decode outputs vs attention over the full-precision K/V, on Gaussian
# K/V whose two outlier channels are 8x larger (they set every per-token range). Measured
# worst of 3 requests: int8 0.034, fp8 0.035, int4 0.172 (its last 5 tokens exact).
ATTENTION_TOLERANCE = {"auto": 1e-6, "int8": 0.05, "fp8": 0.05, "int4": 0.25}


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_attention_over_quantized_pages(fmt):
    lengths = [37, 64, 5]
    store = storage(fmt, num_pages=20)
    queries = activations((3, 9, D), 11, outlier_channels=())
    tables, states, keys, values = [], [], [], []
    for i, n in enumerate(lengths):
        table = list(range(6 * i, 6 * i + 5))
        key, value = activations((KVH, n, D), 20 + i), activations((KVH, n, D), 30 + i)
        state = LayerKV(block_table=table)
        store.write_slots(state, table, 0, key[:, :-1], value[:, :-1])
        state.num_slots = n - 1
        tables.append(table)
        states.append(state)
        keys.append(key)
        values.append(value)
    # The new token goes through the decode write path.
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lengths)])
    store.write_decode(
        slots,
        states,
        torch.stack([k[:, -1] for k in keys]),
        torch.stack([v[:, -1] for v in values]),
    )
    params = DecodeParams(
        torch.tensor(tables), torch.tensor(lengths), D**-0.5, torch.zeros(3, dtype=torch.long)
    )
    out, lse, _ = store.decode_attention(queries, params, states)
    errors = []
    for i in range(3):
        expected, _ = attention_with_lse(queries[i][:, None], keys[i], values[i], D**-0.5)
        errors.append(((out[i] - expected[:, 0]).norm() / expected.norm()).item())
    assert max(errors) <= ATTENTION_TOLERANCE[fmt], (fmt, errors)
    assert torch.isfinite(lse).all()


# ----------------------------------------------------------------- page kinds
def test_block_pool_kinds_allocate_and_free_in_their_range():
    pool = BlockPool([4, 2])
    assert pool.kind_starts == [0, 4] and pool.num_pages == 6
    full = pool.allocate(2, kind=1)
    assert full == [4, 5] and pool.num_available(1) == 0 and pool.num_available(0) == 4
    with pytest.raises(RuntimeError):
        pool.allocate(1, kind=1)
    pool.free(full)
    assert pool.num_available(1) == 2 and pool.allocate(1, kind=0) == [0]


def make_manager(num_pages, full_layers=(0,), fmt="int8"):
    specs = [LayerSpec() for _ in range(3)]
    return KVCacheManager(
        specs,
        num_pages,
        BS,
        KVH,
        D,
        torch.float32,
        kv_cache_dtype=fmt,
        full_precision_layers=full_layers,
    )


def test_manager_draws_each_layer_from_its_kind():
    kv = make_manager((8, 3))
    assert kv.layer_kinds == [1, 0, 0]
    assert kv.storage(0).kv_cache_dtype == "auto" and kv.storage(1).kv_cache_dtype == "int8"
    kv.register("a", [None] * 3, KVPolicy())
    assert kv.can_allocate("a", 40, True, True)  # 3 pages per layer: 3 full, 6 int8
    steps = kv.allocate("a", 40, True, True)
    assert all(p >= 8 for p in steps[0].block_table)
    assert all(p < 8 for s in steps[1:] for p in s.block_table)
    kv.register("b", [None] * 3, KVPolicy())
    assert not kv.can_allocate("b", 1, True, True)  # the full-precision kind is used up
    kv.free("a")
    kv.free("b")
    kv.check_invariants()
    assert kv.num_free_pages == 11


def test_manager_refuses_bad_layers_and_sizes():
    with pytest.raises(ValueError, match="kv_cache_full_precision_layers"):
        make_manager((8, 3), full_layers=(5,))
    with pytest.raises(ValueError, match="num_pages"):
        make_manager(8)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_manager(8, full_layers=(), fmt="int3")


def test_cache_config_validation():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int2").validate()
    with pytest.raises(ValueError, match="quantized kv_cache_dtype"):
        CacheConfig(kv_cache_full_precision_layers=(0,)).validate()
    with pytest.raises(ValueError, match="layer indices"):
        CacheConfig(kv_cache_dtype="int8", kv_cache_full_precision_layers=(-1,)).validate()
    CacheConfig(kv_cache_dtype="int4", kv_cache_full_precision_layers=(0, 1)).validate()


class _ReferenceInt4Backend(TorchBackend):
    """Reads int4 pages "in place" with the reference kernel (dequantize, dense attention), so
    the storage takes its page + residual merge route without the native extension."""

    def supports_int4_decode(self, query, *pages) -> bool:
        return True


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_int4_residual_merge_equals_the_dequantized_path(softcap):
    """Pages through the kernel + residuals merged by log-sum-exp = one dense attention."""
    lengths = [37, 64, 5, 16]  # residuals of 5, 0 (page boundary), 5 (no full page), 0
    store = storage("int4", num_pages=24)
    queries = activations((4, 9, D), 12, outlier_channels=())
    tables, states = [], []
    for i, n in enumerate(lengths):
        table = list(range(6 * i, 6 * i + 5))
        key, value = activations((KVH, n, D), 40 + i), activations((KVH, n, D), 50 + i)
        state = LayerKV(block_table=table)
        store.write_slots(state, table, 0, key, value)
        tables.append(table)
        states.append(state)
    params = DecodeParams(
        torch.tensor(tables),
        torch.tensor(lengths),
        D**-0.5,
        torch.zeros(4, dtype=torch.long),
        logit_softcap=softcap,
    )
    store.backend = TorchBackend()  # no int4 kernel: the dequantizing route
    expected = store.decode_attention(queries, params, states)
    store.backend = _ReferenceInt4Backend()
    merged = store.decode_attention(queries, params, states)
    torch.testing.assert_close(merged[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged[1], expected[1], atol=1e-5, rtol=1e-5)
