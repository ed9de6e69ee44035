"""Native paged CPU kernels against the PyTorch reference (``attention/torch_ref.py``).

Every kernel variant this CPU runs is checked (``avx2_w16`` runs the 16-lane AVX-512 code on
AVX2 machines; ``avx512_amx``, bf16 on AMX tiles, runs where the CPU has AMX). fp32 within
1e-5, bf16 against the fp32 reference of the same bf16 inputs within rtol 1.6e-2 + atol 1e-2
(the project's bf16 kernel tolerance). The first test builds the extension (cached in ``~/.cache/sparsekv/ext``
afterwards, one folder per version of the sources).
"""

from __future__ import annotations

import os

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.backends import DecodeParams
from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.cpu import build, ops
from sparsekv.attention.cpu.memory import advise_huge_pages
from sparsekv.attention.reference import window_scores_paged as ref_window_scores
from sparsekv.engine.engine_setup import cpu_flags

backend = CpuNativeBackend()
FP32_TOL = {"atol": 1e-5, "rtol": 0.0}
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
RAGGED_LENS = [1, 15, 16, 17, 100, 1999]


AMX_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")


@pytest.fixture(scope="module")
def isas() -> tuple[str, ...]:
    if build.native_disabled():
        pytest.skip("SPARSEKV_DISABLE_NATIVE is set")
    assert build.load_extension() is not None, "the native extension failed to build"
    return ops.available_isas()


def make_paged(lens, num_kv_heads, block_size, head_dim, dtype, first_slots=None, seed=0):
    """Random pool with each request's held pages at shuffled, non-contiguous page ids."""
    gen = torch.Generator().manual_seed(seed)
    first = first_slots or [0] * len(lens)
    blocks = [-(-(n - f) // block_size) for n, f in zip(lens, first)]
    max_blocks = max(blocks, default=0) + 1  # one padding entry at least
    num_pages = sum(blocks) + 7
    pool = torch.randn(num_pages, 2, num_kv_heads, block_size, head_dim, generator=gen)
    pool = pool.to(dtype)
    perm = torch.randperm(num_pages, generator=gen)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    used = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[used : used + nb]
        tables[i, nb:] = perm[-1]  # padding: any valid page id
        used += nb
    return pool, tables, torch.tensor(lens), torch.tensor(first)


def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


def reference_decode(query, pool, tables, lens, scale, first=None, window=None, softcap=None):
    """torch_ref on fp32 copies, one request at a time (its own table width: the batched
    reference gathers every request's padded table, too slow for a test matrix)."""
    first = torch.zeros_like(lens) if first is None else first
    block_size = pool.shape[3]
    outs, lses, masses = [], [], []
    for i in range(len(lens)):
        num_blocks = -(-(int(lens[i]) - int(first[i])) // block_size)
        out, lse, mass = torch_ref.paged_decode_attention(
            query[i : i + 1].float(),
            pool.float(),
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


def run_decode(isa, query, pool, tables, lens, first=None, window=None, softcap=None):
    """Native result and the fp32 reference of the same (possibly bf16) inputs."""
    scale = query.shape[-1] ** -0.5
    got = ops.paged_decode_attention(
        query, pool, tables, lens, scale, first, window, softcap, True, isa=isa
    )
    return got, reference_decode(query, pool, tables, lens, scale, first, window, softcap)


@pytest.mark.kernel_variant("decode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_decode_matches_reference(isas, dtype, group, head_dim, block_size):
    num_kv_heads = 2
    pool, tables, lens, _ = make_paged(RAGGED_LENS, num_kv_heads, block_size, head_dim, dtype)
    query = torch.randn(len(RAGGED_LENS), num_kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    ref_out, ref_lse, ref_mass = reference_decode(query, pool, tables, lens, scale)
    for isa in isas:
        out, lse, mass = ops.paged_decode_attention(
            query, pool, tables, lens, scale, return_attn_mass=True, isa=isa
        )
        assert out.dtype == dtype and out.shape == ref_out.shape
        check(out, ref_out, dtype)
        torch.testing.assert_close(lse, ref_lse, **FP32_TOL)
        torch.testing.assert_close(mass, ref_mass, **FP32_TOL)


@pytest.mark.kernel_variant("decode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [2, 5, 6, 7, 8, 16, 17, 24])
def test_decode_any_group_size(isas, group, dtype):
    # 17 and 24 take two head blocks on AMX (16 heads per tile pass).
    pool, tables, lens, _ = make_paged([33, 200], 1, 16, 64, dtype, seed=group)
    query = torch.randn(2, group, 64).to(dtype)
    for isa in isas:
        (out, lse, mass), (ref_out, ref_lse, ref_mass) = run_decode(isa, query, pool, tables, lens)
        check(out, ref_out, dtype)
        torch.testing.assert_close(lse, ref_lse, **FP32_TOL)
        torch.testing.assert_close(mass, ref_mass, **FP32_TOL)


@pytest.mark.kernel_variant("decode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 24, 48])
def test_decode_and_window_block_sizes_off_16(isas, dtype, block_size):
    # AMX tiles take 16 key rows: a page tail of fewer rows is staged and zero-padded.
    lens, first = [1, 23, 100, 333], [0, 0, (100 // block_size - 1) * block_size, 0]
    pool, tables, lens_t, first_t = make_paged(lens, 2, block_size, 128, dtype, first)
    query = torch.randn(len(lens), 6, 128).to(dtype)
    window_queries = torch.randn(6, 7, 128).to(dtype)
    keys, _ = torch_ref.gather_kv(pool, tables[3], 333)
    logits = window_queries.float() @ keys.float().repeat_interleave(3, 0).transpose(1, 2)
    lse = torch.logsumexp(logits * 128**-0.5, dim=-1)
    want = ref_window_scores(window_queries.float(), lse, pool.float(), tables[3], 333, 128**-0.5)
    for isa in isas:
        for window in (None, 37):
            (out, lse_got, mass), (ref_out, ref_lse, ref_mass) = run_decode(
                isa, query, pool, tables, lens_t, first_t, window
            )
            check(out, ref_out, dtype)
            torch.testing.assert_close(lse_got, ref_lse, **FP32_TOL)
            torch.testing.assert_close(mass, ref_mass, **FP32_TOL)
        got = ops.window_scores_paged(window_queries, lse, pool, tables[3], 333, 128**-0.5, isa=isa)
        torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.kernel_variant("decode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_sliding_window_first_slots(isas, dtype):
    lens, first = [40, 100, 1000, 17, 64], [16, 48, 960, 0, 32]
    pool, tables, lens_t, first_t = make_paged(lens, 2, 16, 64, dtype, first)
    query = torch.randn(len(lens), 6, 64).to(dtype)
    for window in (20, 37, 64):
        for isa in isas:
            (out, lse, mass), (ref_out, ref_lse, ref_mass) = run_decode(
                isa, query, pool, tables, lens_t, first_t, window
            )
            check(out, ref_out, dtype)
            torch.testing.assert_close(lse, ref_lse, **FP32_TOL)
            torch.testing.assert_close(mass, ref_mass, **FP32_TOL)


@pytest.mark.kernel_variant("decode")
def test_decode_logit_softcap(isas):
    pool, tables, lens, _ = make_paged([5, 300], 2, 32, 128, torch.float32)
    query = torch.randn(2, 8, 128) * 4
    for isa in isas:
        (out, lse, mass), (ref_out, ref_lse, ref_mass) = run_decode(
            isa, query, pool, tables, lens, softcap=3.0
        )
        torch.testing.assert_close(out, ref_out, **FP32_TOL)
        torch.testing.assert_close(lse, ref_lse, **FP32_TOL)
        torch.testing.assert_close(mass, ref_mass, **FP32_TOL)


@pytest.mark.kernel_variant("decode")
def test_decode_long_single_request_splits(isas):
    # One (request, KV head) of 5000 slots is split across threads and merged by lse.
    pool, tables, lens, _ = make_paged([5000], 1, 16, 64, torch.float32)
    query = torch.randn(1, 4, 64)
    for isa in isas:
        (out, lse, _), (ref_out, ref_lse, _) = run_decode(isa, query, pool, tables, lens)
        torch.testing.assert_close(out, ref_out, **FP32_TOL)
        torch.testing.assert_close(lse, ref_lse, **FP32_TOL)


@pytest.mark.kernel_variant("decode")
def test_decode_ignores_garbage_in_unheld_slots(isas):
    # Slots past seq_len in the last page and padding pages may hold anything (torch.empty).
    pool, tables, lens, _ = make_paged([17, 40], 2, 16, 64, torch.float32)
    clean = pool.clone()
    dirty = pool.clone()
    for i, n in enumerate([17, 40]):
        last = tables[i, (n - 1) // 16]
        clean[last, :, :, n % 16 :] = 0.0
        dirty[last, :, :, n % 16 :] = float("nan")
    query = torch.randn(2, 4, 64)
    want = torch_ref.paged_decode_attention(query, clean, tables, lens, 0.125)
    for isa in isas:
        got = ops.paged_decode_attention(query, dirty, tables, lens, 0.125, isa=isa)
        torch.testing.assert_close(got[0], want[0], **FP32_TOL)
        torch.testing.assert_close(got[1], want[1], **FP32_TOL)


@pytest.mark.kernel_variant("decode")
def test_decode_empty_batch_and_no_mass(isas):
    pool, tables, lens, _ = make_paged([3], 2, 16, 64, torch.float32)
    params = DecodeParams(tables[:0], lens[:0], 0.125, return_attn_mass=True)
    out, lse, mass = backend.paged_decode(torch.randn(0, 4, 64), pool, params)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4) and mass.shape == (0, 2, 0)
    out, lse, mass = backend.paged_decode(
        torch.randn(1, 4, 64), pool, DecodeParams(tables, lens, 0.125)
    )
    assert mass is None and out.shape == (1, 4, 64)


@pytest.mark.kernel_variant("decode")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_window_scores_match_reference(isas, dtype, group, head_dim, block_size):
    num_kv_heads = 2
    for num_slots, window in ((1, 1), (17, 5), (300, 32)):
        pool, tables, _, _ = make_paged([num_slots], num_kv_heads, block_size, head_dim, dtype)
        queries = torch.randn(num_kv_heads * group, window, head_dim).to(dtype)
        keys, _ = torch_ref.gather_kv(pool, tables[0], num_slots)
        logits = queries.float() @ keys.float().repeat_interleave(group, 0).transpose(1, 2)
        lse = torch.logsumexp(logits * head_dim**-0.5, dim=-1)  # [num_heads, window]
        scale = head_dim**-0.5
        want = ref_window_scores(queries.float(), lse, pool.float(), tables[0], num_slots, scale)
        for isa in isas:
            got = ops.window_scores_paged(queries, lse, pool, tables[0], num_slots, scale, isa=isa)
            assert got.shape == (num_kv_heads * group, num_slots) and got.dtype == torch.float32
            torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.kernel_variant("decode")
def test_backend_window_scores(isas):
    pool, tables, _, _ = make_paged([100], 3, 16, 64, torch.float32)
    # A given LSE above every logit here (|q . k| * 0.125 stays far below 8): the fused kernel
    # caps terms at 1 where a given LSE is below a logit, which the reference does not.
    queries, lse = torch.randn(9, 8, 64), torch.full((9, 8), 8.0)
    got, got_lse = backend.window_scores_paged(queries, pool, tables[:1], 100, lse, 0.125)
    assert torch.equal(got_lse, lse)
    want = ref_window_scores(queries, lse, pool, tables[0], 100, 0.125)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_queries", [1, 37, 300])
def test_prefill_attention_equals_reference(dtype, num_queries):
    query = torch.randn(9, num_queries, 64).to(dtype)
    key, value = torch.randn(3, 300, 64).to(dtype), torch.randn(3, 300, 64).to(dtype)
    out, lse = backend.prefill_attention(query, key, value, 0.125)
    # The fp32 oracle on the same values: both dtypes run on the native prefill kernel (bf16 lse
    # ~3e-6 from exact on AMX; fp32 on its fp32-FMA variants within 1e-5).
    ref_out, ref_lse = torch_ref.attention_with_lse(
        query.float(), key.float(), value.float(), 0.125
    )
    ref_out = ref_out.to(dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
    else:  # the bf16 kernel tolerance for the output
        torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1.6e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)


@pytest.mark.kernel_variant("decode")
def test_kernel_variants_match_cpu_flags(isas):
    assert isas[-1] == "generic"
    status = build.load_extension().amx_status()
    assert ("avx512_amx" in isas) == (status == "ok"), status
    if "avx512_amx" in isas:  # listed only where CPUID shows AMX (and Linux granted the tiles)
        assert set(AMX_FLAGS) <= cpu_flags() and "avx512" in isas
        assert ops.pick_isa(64) == "avx512_amx" or ops.ISA_ENV in os.environ


@pytest.mark.kernel_variant("decode")
def test_bf16_decode_softcap_window_and_mass(isas):
    # Every variant against the reference where its blocks meet ragged edges (on AMX, its
    # tiles): unaligned first slots and sliding windows (masked row groups), odd tile lengths
    # (value pairs padded with zero rows), soft-cap, and head_dim 256 (eight tile chunks).
    lens, first = [1, 17, 49, 1000, 777], [0, 0, 16, 496, 0]
    for head_dim in (64, 256):
        pool, tables, lens_t, first_t = make_paged(lens, 2, 16, head_dim, torch.bfloat16, first)
        query = (torch.randn(len(lens), 6, head_dim) * 2).to(torch.bfloat16)
        for window, softcap in ((None, None), (45, None), (None, 5.0), (301, 2.0)):
            want = reference_decode(
                query, pool, tables, lens_t, head_dim**-0.5, first_t, window, softcap
            )
            for isa in isas:
                out, lse, mass = ops.paged_decode_attention(
                    query,
                    pool,
                    tables,
                    lens_t,
                    head_dim**-0.5,
                    first_t,
                    window,
                    softcap,
                    True,
                    isa=isa,
                )
                check(out, want[0], torch.bfloat16)
                torch.testing.assert_close(lse, want[1], **FP32_TOL)
                torch.testing.assert_close(mass, want[2], **FP32_TOL)


@pytest.mark.kernel_variant("decode")
def test_fp32_and_mixed_dtypes_on_every_variant(isas):
    # fp32 pools never go through bf16 tiles on AMX; fp32 window queries over a bf16 pool
    # neither; every other variant takes them on the same vector kernels.
    pool, tables, lens, _ = make_paged([300], 2, 16, 64, torch.float32)
    query = torch.randn(1, 6, 64)
    queries, lse = torch.randn(6, 4, 64), torch.full((6, 4), 6.0)
    pool16 = pool.to(torch.bfloat16)
    want = ref_window_scores(queries, lse, pool16.float(), tables[0], 300, 0.125)
    for isa in isas:
        (out, _, _), (ref_out, _, _) = run_decode(isa, query, pool, tables, lens)
        torch.testing.assert_close(out, ref_out, **FP32_TOL)
        got = ops.window_scores_paged(queries, lse, pool16, tables[0], 300, 0.125, isa=isa)
        torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.kernel_variant("decode")
def test_isa_env_forces_each_variant(isas, monkeypatch):
    pool, tables, lens, _ = make_paged([70], 2, 16, 64, torch.bfloat16)
    query = torch.randn(1, 6, 64).to(torch.bfloat16)
    want = reference_decode(query, pool, tables, lens, 0.125)[0]
    for isa in isas:
        monkeypatch.setenv(ops.ISA_ENV, isa)
        assert ops.pick_isa(64) == isa
        got = backend.paged_decode(query, pool, DecodeParams(tables, lens, 0.125))[0]
        check(got, want, torch.bfloat16)
    monkeypatch.setenv(ops.ISA_ENV, "no_such_isa")
    with pytest.warns(RuntimeWarning, match="SPARSEKV_KERNEL_ISA"):
        assert ops.pick_isa(64) == next(i for i in isas if i != "avx2_w16")


@pytest.mark.kernel_variant("decode")
def test_step_scope_reads_the_environment_on_entry(isas, monkeypatch):
    pool, tables, lens, _ = make_paged([70], 2, 16, 64, torch.bfloat16)
    query = torch.randn(1, 6, 64).to(torch.bfloat16)
    params = DecodeParams(tables, lens, 0.125)
    want = backend.paged_decode(query, pool, params)[0]
    first, last = isas[0], isas[-1]
    monkeypatch.setenv(ops.ISA_ENV, first)
    with backend.step_scope():
        monkeypatch.setenv(ops.ISA_ENV, last)  # not seen until the scope ends
        assert ops.pick_isa(64) == first
        with backend.step_scope():
            assert ops.pick_isa(64) == last
        assert ops.pick_isa(64) == first
        assert torch.equal(backend.paged_decode(query, pool, params)[0], want)
    assert ops._scope.get() is None and ops.pick_isa(64) == last
    monkeypatch.setenv("SPARSEKV_DISABLE_NATIVE", "1")
    with backend.step_scope():  # resolved without the extension: the reference route
        assert ops.pick_isa(64) is None
        got = backend.paged_decode(query, pool, params)[0]
    check(
        got, torch_ref.paged_decode_attention(query, pool, tables, lens, 0.125)[0], torch.bfloat16
    )


def test_disable_env_falls_back_to_reference(monkeypatch):
    monkeypatch.setenv("SPARSEKV_DISABLE_NATIVE", "1")
    assert build.load_extension() is None and not backend.prepare()
    pool, tables, lens, _ = make_paged([5, 40], 2, 16, 64, torch.float32)
    query = torch.randn(2, 4, 64)
    got = backend.paged_decode(
        query, pool, DecodeParams(tables, lens, 0.125, return_attn_mass=True)
    )
    want = torch_ref.paged_decode_attention(
        query, pool, tables, lens, 0.125, None, None, None, True
    )
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    queries, lse = torch.randn(4, 3, 64), torch.zeros(4, 3)
    got, _ = backend.window_scores_paged(queries, pool, tables[1:], 40, lse, 0.125)
    assert torch.equal(got, ref_window_scores(queries, lse, pool, tables[1], 40, 0.125))


def test_build_directory_follows_the_sources(tmp_path, monkeypatch):
    # Another version of csrc/ (a checkout, a snapshot) must never share a build folder.
    monkeypatch.setenv("SPARSEKV_EXT_DIR", str(tmp_path / "ext"))
    first = build.build_directory()
    assert first.parent == tmp_path / "ext"
    copy = tmp_path / "csrc"
    copy.mkdir()
    for path in build.CSRC_DIR.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(build, "CSRC_DIR", copy)
    assert build.build_directory() == first  # same sources, same folder
    (copy / "kernels.h").write_text((copy / "kernels.h").read_text() + "\n// edited\n")
    assert build.build_directory() != first


def test_build_failure_warns_and_falls_back(monkeypatch):
    def broken(verbose=False):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(build, "compile_extension", broken)
    with pytest.warns(RuntimeWarning, match="falling back"):
        assert build._load_once.__wrapped__() is None
    monkeypatch.setattr(build, "load_extension", lambda: None)
    pool, tables, lens, _ = make_paged([9], 1, 16, 64, torch.bfloat16)
    query = torch.randn(1, 2, 64).to(torch.bfloat16)
    got = backend.paged_decode(query, pool, DecodeParams(tables, lens, 0.125))
    want = torch_ref.paged_decode_attention(query, pool, tables, lens, 0.125)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(RuntimeError, match="not available"):
        ops.paged_decode_attention(query, pool, tables, lens, 0.125)


def test_advise_huge_pages_is_harmless():
    pool = torch.empty(8 << 20, dtype=torch.uint8)
    assert advise_huge_pages(pool) in (True, False)
    assert advise_huge_pages(torch.empty(16)) is False  # smaller than one huge page
    pool.fill_(1)
    assert int(pool[-1]) == 1
