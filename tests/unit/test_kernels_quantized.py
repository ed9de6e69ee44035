"""Native decode over int8 and fp8 pages (``quant_decode.paged_decode_attention_quantized``) against
``torch_ref.paged_decode_attention`` on the same dequantized values (``dequantize_pool``).

Every kernel variant this CPU runs whose width fits ``head_dim`` is checked, for both formats
of ``kv_cache.quant`` and fp32 and bf16 queries. K/V are random with a different magnitude per
slot (so per-slot scales matter), quantized by ``quant.quantize_int8`` / ``quantize_fp8``.
Unheld slots of each last page and the padding pages of the block tables hold garbage (NaN
scales, NaN fp8 codes) that the kernel must never read into a result; the oracle sees zeros.

Tolerances: fp32 queries atol 2e-5 + rtol 2e-5 (outputs reach ~40 and lse ~130 here, as slot
magnitudes vary; the largest error measured over these cases, every variant, was a third of
that, ~1e-6 relative); bf16 queries rtol 1.6e-2 + atol 1e-2 on the output (the bf16 kernel tolerance),
lse and mass as fp32 (the oracle takes the same bf16 query values).
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.cpu import build, ops, quant_decode
from sparsekv.attention.reference import dequantize_pool
from sparsekv.bench import kernels
from sparsekv.kv_cache import quant

FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
QUANTIZE = {"int8": quant.quantize_int8, "fp8": quant.quantize_fp8}
DEQUANTIZE = {"int8": quant.dequantize_int8, "fp8": quant.dequantize_fp8}
RAGGED_LENS = [1, 15, 16, 17, 100, 777]
QUERY_DTYPES = pytest.mark.parametrize(
    "query_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"]
)
FORMATS = pytest.mark.parametrize("fmt", ["int8", "fp8"])


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


def set_garbage(fmt: str, data: torch.Tensor, scales: torch.Tensor, index: tuple) -> None:
    """Fill ``data[index]`` / ``scales[index]`` with what an unwritten page may hold."""
    if fmt == "fp8":
        data.view(torch.uint8)[index] = 0x7F  # NaN
    else:
        data[index] = -128
    scales[index] = float("nan")


def make_quantized(fmt, lens, num_kv_heads, block_size, head_dim, first_slots=None, seed=0):
    """Quantized pool with each request's held pages at shuffled page ids.

    Returns codes, scales (garbage in unheld slots and the padding page), the fp32 oracle pool
    (zeros there), block tables ``[batch, max_blocks]`` (at least one padding entry), seq_lens
    and first_slots.
    """
    gen = torch.Generator().manual_seed(seed)
    first = first_slots or [0] * len(lens)
    blocks = [-(-(n - f) // block_size) for n, f in zip(lens, first)]
    max_blocks = max(blocks, default=0) + 1
    num_pages = sum(blocks) + 3
    shape = (num_pages, 2, num_kv_heads, block_size, head_dim)
    magnitude = torch.exp(torch.randn(*shape[:4], 1, generator=gen))  # per-slot scales differ
    data, scales = QUANTIZE[fmt](torch.randn(shape, generator=gen) * magnitude)
    pool = dequantize_pool(data, scales)
    perm = torch.randperm(num_pages, generator=gen)
    padding = int(perm[-1])  # a page no request holds
    set_garbage(fmt, data, scales, (padding,))
    tables = torch.full((len(lens), max_blocks), padding, dtype=torch.long)
    used = 0
    for i, (n, f, nb) in enumerate(zip(lens, first, blocks)):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        tail = (n - f) % block_size
        if tail:  # unheld slots of the partial last page
            last = int(tables[i, nb - 1])
            set_garbage(fmt, data, scales, (last, slice(None), slice(None), slice(tail, None)))
            pool[last, :, :, tail:] = 0.0
    return data, scales, pool, tables, torch.tensor(lens), torch.tensor(first)


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
    data, scales, pool, tables, lens, _ = case
    scale = query.shape[-1] ** -0.5
    want = reference_decode(query, pool, tables, lens, scale, first, window, softcap)
    tol = FP32_TOL if query.dtype == torch.float32 else BF16_TOL
    for isa in fitting(isas, query.shape[-1]):
        out, lse, mass = quant_decode.paged_decode_attention_quantized(
            query, data, scales, tables, lens, scale, first, window, softcap, True, isa=isa
        )
        assert out.dtype == query.dtype and out.shape == query.shape, isa
        torch.testing.assert_close(out.float(), want[0], **tol, msg=lambda m, i=isa: f"{i}: {m}")
        torch.testing.assert_close(lse, want[1], **FP32_TOL, msg=lambda m, i=isa: f"{i}: {m}")
        torch.testing.assert_close(mass, want[2], **FP32_TOL, msg=lambda m, i=isa: f"{i}: {m}")


@pytest.mark.kernel_variant("decode")
@FORMATS
@QUERY_DTYPES
@pytest.mark.parametrize("block_size", [16, 32])
def test_quantized_decode_matches_reference(isas, fmt, query_dtype, block_size):
    # GQA 9 query heads over 3 KV heads; ragged lengths: 1 slot, partial and exact pages.
    case = make_quantized(fmt, RAGGED_LENS, 3, block_size, 64, seed=block_size)
    query = random_query(len(RAGGED_LENS), 9, 64, query_dtype, block_size)
    check_all(isas, query, case)


@pytest.mark.kernel_variant("decode")
@FORMATS
@QUERY_DTYPES
def test_quantized_decode_head_dim_128(isas, fmt, query_dtype):
    case = make_quantized(fmt, [5, 130, 333], 2, 16, 128, seed=1)
    query = random_query(3, 8, 128, query_dtype, 1)
    check_all(isas, query, case)


@pytest.mark.kernel_variant("decode")
def test_quantized_head_dim_takes_whole_quads(isas):
    # Codes are read 4 per 32-bit lane: head_dim must be a multiple of 4 * lanes (a "quad").
    # head_dim 32 fits generic and avx2 (4 and 8 lanes), not the 16-lane variants.
    ext = build.load_extension()
    case = make_quantized("int8", [50], 1, 16, 32, seed=5)
    data, scales, pool, tables, lens, _ = case
    query = random_query(1, 2, 32, seed=5)
    want = reference_decode(query, pool, tables, lens, 0.2)
    for isa in isas:
        if 32 % (4 * ext.vector_width(isa)) == 0:
            out, lse, _ = quant_decode.paged_decode_attention_quantized(
                query, data, scales, tables, lens, 0.2, isa=isa
            )
            torch.testing.assert_close(out, want[0], **FP32_TOL)
            torch.testing.assert_close(lse, want[1], **FP32_TOL)
        else:
            with pytest.raises(RuntimeError, match="must be a multiple of"):
                quant_decode.paged_decode_attention_quantized(
                    query, data, scales, tables, lens, 0.2, isa=isa
                )
    picked = ops.pick_isa(32, quantized=True)
    assert picked is not None and 32 % (4 * ext.vector_width(picked)) == 0
    assert quant_decode.supports_quantized(query, data, scales)


@pytest.mark.kernel_variant("decode")
@FORMATS
@QUERY_DTYPES
def test_quantized_decode_sliding_window_first_slots(isas, fmt, query_dtype):
    lens, first = [40, 100, 1000, 17, 64], [16, 48, 960, 0, 32]
    case = make_quantized(fmt, lens, 3, 16, 64, first, seed=2)
    query = random_query(len(lens), 9, 64, query_dtype, 2)
    for window in (20, 37, 64):
        check_all(isas, query, case, case[5], window)


@pytest.mark.kernel_variant("decode")
@FORMATS
@QUERY_DTYPES
def test_quantized_decode_logit_softcap(isas, fmt, query_dtype):
    case = make_quantized(fmt, [5, 300], 3, 32, 64, seed=3)
    query = random_query(2, 9, 64, query_dtype, 3, std=4.0)
    check_all(isas, query, case, softcap=3.0)


@pytest.mark.kernel_variant("decode")
@FORMATS
def test_quantized_decode_long_request_splits(isas, fmt):
    # One (request, KV head) of 5000 slots is split across threads and merged by lse.
    case = make_quantized(fmt, [5000], 1, 16, 64, seed=4)
    check_all(isas, random_query(1, 3, 64, seed=4), case)


@pytest.mark.kernel_variant("decode")
@FORMATS
def test_quantized_decode_empty_batch_and_no_mass(isas, fmt):
    data, scales, _, tables, lens, _ = make_quantized(fmt, [3], 3, 16, 64)
    out, lse, mass = quant_decode.paged_decode_attention_quantized(
        torch.randn(0, 9, 64), data, scales, tables[:0], lens[:0], 0.125, return_attn_mass=True
    )
    assert out.shape == (0, 9, 64) and lse.shape == (0, 9) and mass.shape == (0, 3, 0)
    out, lse, mass = quant_decode.paged_decode_attention_quantized(
        torch.randn(1, 9, 64), data, scales, tables, lens, 0.125
    )
    assert mass is None and out.shape == (1, 9, 64) and lse.shape == (1, 9)


@pytest.mark.kernel_variant("decode")
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_every_code_decodes_exactly(isas, fmt):
    # Every code (fp8: all finite ones, subnormals included; int8: -128..127) as the only slot
    # of a request: the output is its value row exactly, and with one-hot queries each head's
    # lse is one key element's logit.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if fmt == "fp8":
        codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN patterns
    rows = codes.view(4, 1, 1, 64)
    data = torch.stack((rows, rows), dim=1)  # [4 pages, K/V, 1 head, block_size 1, 64]
    data = data.view(torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    scales = torch.tensor([0.37, 1.0, 3.0, 1e-3]).view(4, 1, 1, 1).expand(4, 2, 1, 1)
    scales = scales.contiguous()
    pool = dequantize_pool(data, scales)
    query = torch.eye(64).expand(4, 64, 64).contiguous()  # head h reads element h
    tables, lens = torch.arange(4).view(4, 1), torch.ones(4, dtype=torch.long)
    want_lse = pool[:, 0, 0, 0, :] * 0.5  # [4 requests, 64 heads]
    for isa in fitting(isas, 64):
        out, lse, _ = quant_decode.paged_decode_attention_quantized(
            query, data, scales, tables, lens, 0.5, isa=isa
        )
        values = pool[:, 1, 0, 0]  # [4, 64]: every head outputs its request's value row
        assert torch.equal(out, values[:, None, :].expand(4, 64, 64)), isa
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_dequantize_pool_matches_quant(fmt):
    x = torch.randn(3, 2, 2, 16, 64)
    data, scales = QUANTIZE[fmt](x)
    want = DEQUANTIZE[fmt](data, scales, torch.float32)
    assert torch.equal(dequantize_pool(data, scales), want)
    assert dequantize_pool(data, scales, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_scales must have shape"):
        dequantize_pool(data, scales[..., :8])


def strided(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values and shape, not contiguous."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.kernel_variant("decode")
def test_quantized_decode_rejects_bad_arguments(isas):
    data, scales, _, tables, lens, _ = make_quantized("int8", [40], 3, 16, 64)
    query = random_query(1, 9, 64)

    def call(q=query, d=data, s=scales):
        return quant_decode.paged_decode_attention_quantized(
            q, d, s, tables, lens, 0.125, isa="generic"
        )

    bad = [
        ({"s": scales[..., :8].contiguous()}, "kv_scales must be"),
        ({"s": scales[:, :, :, :, None].contiguous()}, "kv_scales must be"),
        ({"s": scales.half()}, "kv_scales must be float32"),
        ({"s": strided(scales)}, "contiguous"),
        ({"d": data.float()}, "kv_data must be int8 or float8_e4m3fn"),
        ({"d": data.view(torch.uint8)}, "kv_data must be int8 or float8_e4m3fn"),
        ({"d": data[:, :, :, :, :32].contiguous(), "s": scales}, "head_dim"),
        ({"d": strided(data)}, "contiguous"),
        ({"d": data[:, 0]}, r"kv_data must be \[num_pages"),
        ({"q": query.half()}, "query must be float32 or bfloat16"),
        ({"q": query[:, :8]}, "multiple of num_kv_heads"),
    ]
    for kwargs, message in bad:
        with pytest.raises(RuntimeError, match=message):
            call(**kwargs)
    with pytest.raises(RuntimeError, match="not supported on this CPU"):
        quant_decode.paged_decode_attention_quantized(
            query, data, scales, tables, lens, 0.1, isa="x"
        )


@pytest.mark.kernel_variant("decode")
def test_supports_quantized(isas):
    data, scales, *_ = make_quantized("fp8", [20], 3, 16, 64)
    query = random_query(1, 9, 64)
    assert quant_decode.supports_quantized(query, data, scales)
    assert quant_decode.supports_quantized(query.bfloat16(), data.view(torch.int8), scales)
    assert not quant_decode.supports_quantized(query.half(), data, scales)
    assert not quant_decode.supports_quantized(query, data.float(), scales)
    assert not quant_decode.supports_quantized(query, data, scales.double())
    assert not quant_decode.supports_quantized(query, data, scales[..., :8].contiguous())
    assert not quant_decode.supports_quantized(query, strided(data), scales)
    assert not quant_decode.supports_quantized(query, data, strided(scales))
    assert not quant_decode.supports_quantized(query.requires_grad_(), data, scales)


@pytest.mark.kernel_variant("decode")
def test_bench_kv_dtype_rows(isas, capsys):
    # `sparsekv bench kernels --kv-dtypes`: one row per KV dtype at the same shape, with the
    # bytes a call reads (codes + scales) and the rate.
    args = kernels.build_parser().parse_args(
        ["--batch", "2", "--tokens", "40", "--layers", "2", "--repeats", "1", "--isa", "generic"]
    )
    machine = {"read_bandwidth": 1e10}
    rows = {name: kernels.bench_decode_kv(args, name, machine) for name in ("bf16", "int8", "fp8")}
    slots = 2 * 40 * 3 * 2  # requests x tokens x KV heads x (K, V)
    assert rows["bf16"]["bytes_per_call"] == slots * 64 * 2
    assert rows["int8"]["bytes_per_call"] == rows["fp8"]["bytes_per_call"] == slots * (64 + 4)
    assert rows["fp8"]["query_dtype"] == "bf16" and rows["fp8"]["kv_dtype"] == "fp8"
    assert all(row["ms"] > 0 and row["gb_per_s"] > 0 for row in rows.values())
    assert "GB/s" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--kv-dtypes"):
        kernels.run(kernels.build_parser().parse_args(["--kv-dtypes", "int8,int3"]))
