"""Native decode over KIVI int4 pages (``quant_decode.paged_decode_attention_int4``) against
``torch_ref.paged_decode_attention`` on the same dequantized values (``dequantize_int4_pool``).

Every kernel variant this CPU runs whose width fits ``head_dim`` is checked, with fp32 and bf16
queries. K/V are random with outlier channels (a few channels of larger magnitude and offset,
as in the keys of real models, so per-channel key scales and zeros matter), a channel constant
over each page and a constant value row (their scales hit the fp16 floor 2^-24, a subnormal),
quantized by ``quant.quantize_int4_keys`` / ``quantize_int4_values`` one page at a time, as
``Int4Storage`` does. Unheld slots of each partial last page and the padding page of the block
tables hold garbage (random codes, NaN scales and zeros) that the kernel must never read into a
result; the oracle sees zeros there.

Tolerances: the output of fp32 queries atol 1e-5 + rtol 1e-5 (outputs reach ~18 here, and
each is a difference of terms up to ~60: the slot scale times the code, the value zero; the
largest error measured over these cases, every variant, was a third of the tolerance, 1.4e-5
on an output of ~18); lse and mass atol 2e-6 + rtol 2e-6 (measured: a third); bf16 queries
rtol 1.6e-2 + atol 1e-2 on the output (the bf16 kernel tolerance), lse and mass as for fp32 (the oracle
takes the same bf16 query values).
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.cpu import build, ops, quant_decode
from sparsekv.attention.reference import dequantize_int4_pool
from sparsekv.bench import kernels
from sparsekv.kv_cache import quant

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
STAT_TOL = {"atol": 2e-6, "rtol": 2e-6}  # lse and mass
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
RAGGED_LENS = [1, 15, 16, 17, 64, 100, 777]
QUERY_DTYPES = pytest.mark.parametrize(
    "query_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"]
)


@pytest.fixture(scope="module")
def isas() -> tuple[str, ...]:
    if build.native_disabled():
        pytest.skip("SPARSEKV_DISABLE_NATIVE is set")
    assert build.load_extension() is not None, "the native extension failed to build"
    return ops.available_isas()


def fitting(isas: tuple[str, ...], head_dim: int) -> list[str]:
    """The variants whose vector width fits ``head_dim`` (a multiple of 2 * fp32 lanes)."""
    ext = build.load_extension()
    fits = [isa for isa in isas if head_dim % (2 * ext.vector_width(isa)) == 0]
    assert fits, f"no kernel variant for head_dim {head_dim}"
    return fits


def random_query(batch, num_heads, head_dim, dtype=torch.float32, seed=0, std=1.0):
    gen = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(batch, num_heads, head_dim, generator=gen) * std).to(dtype)


def random_kv(shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """``[num_pages, 2, kvh, block_size, head_dim]`` K/V with outlier channels, one channel
    constant over each page and one constant value row per page and head."""
    x = torch.randn(shape, generator=gen)
    outliers = torch.randperm(shape[-1], generator=gen)[:4]
    x[..., outliers] = x[..., outliers] * 6.0 + torch.randn(4, generator=gen) * 8.0
    x[:, 0, :, :, outliers[0]] = 2.5  # keys: a constant channel -> scale 2^-24
    x[:, 1, :, 0, :] = -1.25  # values: a constant row -> scale 2^-24
    return x


def quantize_pages(x: torch.Tensor) -> list[torch.Tensor]:
    """codes, key_scale, key_zero, value_scale, value_zero of ``x`` (``random_kv``'s shape),
    contiguous, as ``Int4Storage`` lays them out."""
    key_codes, key_scale, key_zero = quant.quantize_int4_keys(x[:, 0])
    value_codes, value_scale, value_zero = quant.quantize_int4_values(x[:, 1])
    codes = torch.stack((key_codes, value_codes), dim=1)
    return [t.contiguous() for t in (codes, key_scale, key_zero, value_scale, value_zero)]


def set_garbage(tensors: list[torch.Tensor], page: int, slots: slice, gen) -> None:
    """What an unwritten page (or a page's unwritten slots) may hold: random codes, NaN value
    scales and zeros (and NaN key scales and zeros when the whole page is unwritten)."""
    codes, key_scale, key_zero, value_scale, value_zero = tensors
    view = codes[page, :, :, slots]
    view.copy_(torch.randint(0, 256, view.shape, generator=gen, dtype=torch.uint8))
    value_scale[page, :, slots] = float("nan")
    value_zero[page, :, slots] = float("nan")
    if slots == slice(None):
        key_scale[page] = float("nan")
        key_zero[page] = float("nan")


def make_int4(lens, num_kv_heads, block_size, head_dim, first_slots=None, seed=0):
    """An int4 pool with each request's held pages at shuffled page ids.

    Returns the five pool tensors (garbage in unheld slots and the padding page), the fp32
    oracle pool (zeros there), block tables ``[batch, max_blocks]`` (at least one padding
    entry), seq_lens and first_slots.
    """
    gen = torch.Generator().manual_seed(seed)
    first = first_slots or [0] * len(lens)
    blocks = [-(-(n - f) // block_size) for n, f in zip(lens, first)]
    max_blocks = max(blocks, default=0) + 1
    num_pages = sum(blocks) + 3
    tensors = quantize_pages(random_kv((num_pages, 2, num_kv_heads, block_size, head_dim), gen))
    pool = dequantize_int4_pool(*tensors)
    perm = torch.randperm(num_pages, generator=gen)
    padding = int(perm[-1])  # a page no request holds
    set_garbage(tensors, padding, slice(None), gen)
    tables = torch.full((len(lens), max_blocks), padding, dtype=torch.long)
    used = 0
    for i, (n, f, nb) in enumerate(zip(lens, first, blocks)):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        tail = (n - f) % block_size
        if tail:  # unheld slots of the partial last page
            last = int(tables[i, nb - 1])
            set_garbage(tensors, last, slice(tail, None), gen)
            pool[last, :, :, tail:] = 0.0
    return tensors, pool, tables, torch.tensor(lens), torch.tensor(first)


def reference_decode(query, pool, tables, lens, scale, first=None, window=None, softcap=None):
    """torch_ref over the fp32 oracle pool, one request at a time over its held pages only
    (the padding page holds garbage)."""
    first = torch.zeros_like(lens) if first is None else first
    block_size = pool.shape[3]
    outs, lses, masses = [], [], []
    for i in range(len(lens)):
        num_blocks = -(-(int(lens[i]) - int(first[i])) // block_size)
        out, lse, mass = torch_ref.paged_decode_attention(
            query[i : i + 1].float(),
            pool,
            tables[i : i + 1, :num_blocks],
            lens[i : i + 1],
            scale,
            first[i : i + 1],
            window,
            softcap,
            True,
        )
        outs.append(out)
        lses.append(lse)
        masses.append(
            torch.nn.functional.pad(mass, (0, tables.shape[1] * block_size - mass.shape[-1]))
        )
    return torch.cat(outs), torch.cat(lses), torch.cat(masses)


def check_all(isas, query, case, first=None, window=None, softcap=None) -> None:
    """Every fitting variant against the oracle: out in the query dtype's tolerance, lse and
    mass in fp32's."""
    tensors, pool, tables, lens, _ = case
    scale = query.shape[-1] ** -0.5
    want = reference_decode(query, pool, tables, lens, scale, first, window, softcap)
    tol = FP32_TOL if query.dtype == torch.float32 else BF16_TOL
    for isa in fitting(isas, query.shape[-1]):
        out, lse, mass = quant_decode.paged_decode_attention_int4(
            query, *tensors, tables, lens, scale, first, window, softcap, True, isa=isa
        )
        assert out.dtype == query.dtype and out.shape == query.shape, isa
        torch.testing.assert_close(out.float(), want[0], **tol, msg=lambda m, i=isa: f"{i}: {m}")
        torch.testing.assert_close(lse, want[1], **STAT_TOL, msg=lambda m, i=isa: f"{i}: {m}")
        torch.testing.assert_close(mass, want[2], **STAT_TOL, msg=lambda m, i=isa: f"{i}: {m}")


@pytest.mark.kernel_variant("decode")
@QUERY_DTYPES
@pytest.mark.parametrize("block_size", [16, 32])
def test_int4_decode_matches_reference(isas, query_dtype, block_size):
    # GQA 9 query heads over 3 KV heads; ragged lengths: 1 slot, partial and whole pages.
    case = make_int4(RAGGED_LENS, 3, block_size, 64, seed=block_size)
    query = random_query(len(RAGGED_LENS), 9, 64, query_dtype, block_size)
    check_all(isas, query, case)


@pytest.mark.kernel_variant("decode")
@QUERY_DTYPES
def test_int4_decode_head_dim_128(isas, query_dtype):
    case = make_int4([5, 128, 333], 2, 16, 128, seed=1)
    query = random_query(3, 8, 128, query_dtype, 1)
    check_all(isas, query, case)


@pytest.mark.kernel_variant("decode")
@QUERY_DTYPES
def test_int4_decode_sliding_window_first_slots(isas, query_dtype):
    lens, first = [40, 100, 1000, 17, 64], [16, 48, 960, 0, 32]
    case = make_int4(lens, 3, 16, 64, first, seed=2)
    query = random_query(len(lens), 9, 64, query_dtype, 2)
    for window in (20, 37, 64):
        check_all(isas, query, case, case[4], window)


@pytest.mark.kernel_variant("decode")
@QUERY_DTYPES
def test_int4_decode_logit_softcap(isas, query_dtype):
    case = make_int4([5, 300], 3, 32, 64, seed=3)
    query = random_query(2, 9, 64, query_dtype, 3, std=4.0)
    check_all(isas, query, case, softcap=3.0)


@pytest.mark.kernel_variant("decode")
def test_int4_head_dim_takes_whole_chunks(isas):
    # A chunk is 2 * lanes elements (lanes bytes of codes): head_dim 48 fits generic and avx2
    # (4 and 8 lanes), not the 16-lane variants. block_size 8 < 16 lanes: slot by slot.
    ext = build.load_extension()
    tensors, pool, tables, lens, _ = make_int4([50, 8], 1, 8, 48, seed=5)
    query = random_query(2, 2, 48, seed=5)
    want = reference_decode(query, pool, tables, lens, 0.2)
    for isa in isas:
        if 48 % (2 * ext.vector_width(isa)) == 0:
            out, lse, _ = quant_decode.paged_decode_attention_int4(
                query, *tensors, tables, lens, 0.2, isa=isa
            )
            torch.testing.assert_close(out, want[0], **FP32_TOL)
            torch.testing.assert_close(lse, want[1], **STAT_TOL)
        else:
            with pytest.raises(RuntimeError, match="head_dim must be a multiple of"):
                quant_decode.paged_decode_attention_int4(
                    query, *tensors, tables, lens, 0.2, isa=isa
                )
    picked = ops.pick_isa(48)
    assert picked is not None and 48 % (2 * ext.vector_width(picked)) == 0
    assert quant_decode.supports_int4(query, *tensors)


@pytest.mark.kernel_variant("decode")
def test_int4_decode_long_request_splits(isas):
    # One (request, KV head) of 5000 slots is split across threads and merged by lse.
    case = make_int4([5008], 1, 16, 64, seed=4)
    check_all(isas, random_query(1, 3, 64, seed=4), case)


@pytest.mark.kernel_variant("decode")
def test_int4_decode_empty_batch_and_no_mass(isas):
    tensors, _, tables, lens, _ = make_int4([3], 3, 16, 64)
    out, lse, mass = quant_decode.paged_decode_attention_int4(
        torch.randn(0, 9, 64), *tensors, tables[:0], lens[:0], 0.125, return_attn_mass=True
    )
    assert out.shape == (0, 9, 64) and lse.shape == (0, 9) and mass.shape == (0, 3, 0)
    out, lse, mass = quant_decode.paged_decode_attention_int4(
        torch.randn(1, 9, 64), *tensors, tables, lens, 0.125
    )
    assert mass is None and out.shape == (1, 9, 64) and lse.shape == (1, 9)


@pytest.mark.kernel_variant("decode")
def test_int4_request_without_pages(isas):
    # The engine passes seq_len == first_slot for a request whose slots all sit in its residual:
    # zero output, lse -inf.
    tensors, _, tables, _, _ = make_int4([32, 32], 3, 16, 64)
    lens = torch.tensor([32, 0])
    out, lse, _ = quant_decode.paged_decode_attention_int4(
        random_query(2, 9, 64), *tensors, tables, lens, 0.1
    )
    assert torch.equal(out[1], torch.zeros(9, 64)) and bool(torch.isneginf(lse[1]).all())
    assert bool(torch.isfinite(lse[0]).all())


@pytest.mark.kernel_variant("decode")
def test_every_code_and_nibble_decodes_exactly(isas):
    # Value rows that hold every code at every position (both nibbles of every byte) as the
    # only slot of a request: the output is the dequantized row exactly; with one-hot queries
    # each head's lse is one key element's logit.
    d = 64
    rows = (torch.arange(4 * d).view(4, d) * 7 + torch.arange(4)[:, None]) % 16  # [4 pages, d]
    packed = quant.pack_int4(rows).view(4, 1, 1, d // 2)
    codes = torch.stack((packed, packed.flip(-1)), dim=1).contiguous()  # [4, K/V, 1, 1, d / 2]
    key_scale = torch.linspace(0.01, 3.0, 4 * d).view(4, 1, d).half()
    key_zero = torch.linspace(-5.0, 5.0, 4 * d).view(4, 1, d).half()
    value_scale = torch.tensor([0.37, 1.0, 3.0, 1e-3]).view(4, 1, 1).half()
    value_zero = torch.tensor([-2.0, 0.5, 0.0, 7.0]).view(4, 1, 1).half()
    tensors = [codes, key_scale, key_zero, value_scale, value_zero]
    pool = dequantize_int4_pool(*tensors)
    query = torch.eye(d).expand(4, d, d).contiguous()  # head h reads element h
    tables, lens = torch.arange(4).view(4, 1), torch.ones(4, dtype=torch.long)
    for isa in fitting(isas, d):
        out, lse, _ = quant_decode.paged_decode_attention_int4(
            query, *tensors, tables, lens, 0.5, isa=isa
        )
        values = pool[:, 1, 0, 0]  # [4, d]: every head outputs its request's value row
        assert torch.equal(out, values[:, None, :].expand(4, d, d)), isa
        torch.testing.assert_close(lse, pool[:, 0, 0, 0, :] * 0.5, rtol=1e-6, atol=1e-6)


@pytest.mark.kernel_variant("decode")
def test_every_fp16_value_zero_decodes_exactly(isas):
    # Each fp16 bit pattern (subnormals, infinities and NaNs included) as the value zero of a
    # one-slot request with value scale 0: the output is that number on every channel.
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    num = patterns.numel()
    codes = torch.randint(0, 256, (num, 2, 1, 1, 32), dtype=torch.uint8)
    key_scale, key_zero = torch.ones(num, 1, 64).half(), torch.zeros(num, 1, 64).half()
    value_scale, value_zero = torch.zeros(num, 1, 1).half(), patterns.view(num, 1, 1)
    tables, lens = torch.arange(num).view(num, 1), torch.ones(num, dtype=torch.long)
    query = random_query(num, 1, 64)
    want = patterns.float()[:, None, None].expand(num, 1, 64)
    for isa in fitting(isas, 64):
        out, _, _ = quant_decode.paged_decode_attention_int4(
            query, codes, key_scale, key_zero, value_scale, value_zero, tables, lens, 0.1, isa=isa
        )
        torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True, msg=isa)


def test_dequantize_int4_pool_matches_quant():
    x = torch.randn(3, 2, 2, 16, 64)
    tensors = quantize_pages(x)
    pool = dequantize_int4_pool(*tensors)
    codes, key_scale, key_zero, value_scale, value_zero = tensors
    want_k = quant.dequantize_int4_keys(codes[:, 0], key_scale, key_zero, torch.float32)
    want_v = quant.dequantize_int4_values(codes[:, 1], value_scale, value_zero, torch.float32)
    assert torch.equal(pool[:, 0], want_k) and torch.equal(pool[:, 1], want_v)
    assert pool.shape == x.shape and (pool - x).abs().max() < 0.5
    assert dequantize_int4_pool(*tensors, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="value_zero must have shape"):
        dequantize_int4_pool(*tensors[:4], value_zero[..., :8])
    with pytest.raises(ValueError, match="key_scale must have shape"):
        dequantize_int4_pool(codes, key_scale[..., :32], *tensors[2:])


def strided(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values and shape, not contiguous."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.kernel_variant("decode")
def test_int4_decode_rejects_bad_arguments(isas):
    tensors, _, tables, lens, _ = make_int4([40], 3, 16, 64)
    codes, key_scale, key_zero, value_scale, value_zero = tensors
    query = random_query(1, 9, 64)

    def call(q=query, c=codes, ks=key_scale, kz=key_zero, vs=value_scale, vz=value_zero):
        return quant_decode.paged_decode_attention_int4(
            q, c, ks, kz, vs, vz, tables, lens, 0.125, isa="generic"
        )

    bad = [
        ({"c": codes.view(torch.int8)}, "codes must be uint8"),
        ({"c": codes[:, 0]}, r"codes must be \[num_pages"),
        ({"c": strided(codes)}, "codes must be contiguous"),
        ({"c": codes[..., :16].contiguous()}, "key_scale must be"),
        ({"ks": key_scale.float()}, "key_scale must be float16"),
        ({"kz": key_zero[..., :32].contiguous()}, r"key_zero must be \[num_pages, num_kv_heads"),
        ({"kz": strided(key_zero)}, "key_zero must be contiguous"),
        ({"vs": value_scale[:, :, :8].contiguous()}, r"value_scale must be \[num_pages"),
        ({"vs": value_scale.bfloat16()}, "value_scale must be float16"),
        ({"vz": value_zero[:, :2].contiguous()}, "value_zero must be"),
        ({"q": query.half()}, "query must be float32 or bfloat16"),
        ({"q": query[:, :8]}, "multiple of num_kv_heads"),
        ({"q": query[..., :32].contiguous()}, r"head_dim of query \(32\) and the pool \(64\)"),
    ]
    for kwargs, message in bad:
        with pytest.raises(RuntimeError, match=message):
            call(**kwargs)
    with pytest.raises(RuntimeError, match="not supported on this CPU"):
        quant_decode.paged_decode_attention_int4(query, *tensors, tables, lens, 0.1, isa="x")
    with pytest.raises(RuntimeError, match="block table entry out of range"):
        quant_decode.paged_decode_attention_int4(query, *tensors, tables + 100, lens, 0.1)


@pytest.mark.kernel_variant("decode")
def test_supports_int4(isas):
    tensors, *_ = make_int4([20], 3, 16, 64)
    codes, key_scale, key_zero, value_scale, value_zero = tensors
    query = random_query(1, 9, 64)
    assert quant_decode.supports_int4(query, *tensors)
    assert quant_decode.supports_int4(query.bfloat16(), *tensors)
    assert not quant_decode.supports_int4(query.half(), *tensors)
    assert not quant_decode.supports_int4(query[..., :32], *tensors)
    assert not quant_decode.supports_int4(query.requires_grad_(), *tensors)
    query = random_query(1, 9, 64)
    assert not quant_decode.supports_int4(query, codes.view(torch.int8), *tensors[1:])
    assert not quant_decode.supports_int4(query, strided(codes), *tensors[1:])
    assert not quant_decode.supports_int4(query, codes[:, 0], *tensors[1:])
    assert not quant_decode.supports_int4(query, codes, key_scale.float(), *tensors[2:])
    assert not quant_decode.supports_int4(query, codes, key_scale, strided(key_zero), *tensors[3:])
    assert not quant_decode.supports_int4(query, *tensors[:3], value_scale[..., :8], value_zero)
    assert not quant_decode.supports_int4(query, *tensors[:4], value_zero.bfloat16())


@pytest.mark.kernel_variant("decode")
def test_bench_int4_row(isas, capsys):
    # `sparsekv bench kernels --kv-dtypes ...,int4`: bytes per call count the codes (half a
    # byte per element) and the fp16 scales and zeros (per channel of a page for keys, per slot
    # for values).
    args = kernels.build_parser().parse_args(
        ["--batch", "2", "--tokens", "40", "--layers", "2", "--repeats", "1", "--isa", "generic"]
    )
    row = kernels.bench_decode_kv(args, "int4", {"read_bandwidth": 1e10})
    pages = 2 * 3 * 3  # requests x pages (40 tokens, block_size 16) x KV heads
    slots = 2 * 40 * 3
    codes = slots * 2 * 32
    assert row["bytes_per_call"] == codes + pages * 2 * 64 * 2 + slots * 2 * 2
    assert row["kv_dtype"] == "int4" and row["query_dtype"] == "bf16"
    assert row["ms"] > 0 and row["gb_per_s"] > 0
    assert "GB/s" in capsys.readouterr().out
