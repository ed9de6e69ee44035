"""The multi-query paged attention kernel (``attention.cpu.chunk_paged``) against the PyTorch
oracle: ragged batches of chunks (1..64 rows) over held slots read in place from shuffled pages,
GQA, sliding windows, fp32 (1e-5) and bf16 pages, on every variant this CPU runs."""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.cpu import build, chunk_paged
from sparsekv.attention.cpu import ops as native_ops

FP32_TOL = {"atol": 1e-5, "rtol": 0.0}
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}  # the output rounded to bf16
# The avx512_amx and avx512_bf16 variants' dot products round bf16 pages' queries to bf16
# (logits off by ~|q| |k| 2^-9): their LSE is checked to this instead of fp32's.
BF16_DOT_LSE_TOL = {"atol": 5e-3, "rtol": 0.0}
BF16_DOT_ISAS = ("avx512_amx", "avx512_bf16")
ISA_ENV = "SPARSEKV_KERNEL_ISA"


@pytest.fixture(scope="module")
def isas() -> tuple[str, ...]:
    if build.native_disabled():
        pytest.skip("SPARSEKV_DISABLE_NATIVE is set")
    assert build.load_extension() is not None, "the native extension failed to build"
    return chunk_paged.chunk_isas()


def make_batch(cached, rows, num_kv_heads, group, block_size, head_dim, dtype, seed=0):
    """Pool with each sequence's held slots on shuffled pages, and the chunks' tensors."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in cached]
    num_pages = sum(blocks) + 3
    pool = torch.randn(num_pages, 2, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_pages, generator=g).tolist()
    tables = torch.full((len(cached), max(blocks) + 1), num_pages + 5, dtype=torch.long)
    for i, n in enumerate(blocks):  # padding entries hold an invalid id: never read
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.long)
    total = sum(rows)
    query = torch.randn(num_kv_heads * group, total, head_dim, generator=g).to(dtype)
    key, value = torch.randn(2, num_kv_heads, total, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.long)
    return pool, tables, starts, query, key, value


def reference(pool, tables, starts, cached, query, key, value, scale, window):
    """Per sequence: the held slots gathered, the chunk appended, fp32 attention with LSE."""
    outs, lses = [], []
    for b, n in enumerate(cached):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        ck, cv = torch_ref.gather_kv(pool.float(), tables[b, : -(-n // pool.shape[3])], n)
        out, lse = torch_ref.attention_with_lse(
            query[:, rows].float(),
            torch.cat([ck, key[:, rows].float()], 1),
            torch.cat([cv, value[:, rows].float()], 1),
            scale,
            window,
        )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 1)


def check(isa, monkeypatch, cached, rows, kvh, group, block_size, head_dim, dtype, window):
    monkeypatch.setenv(ISA_ENV, isa)
    assert chunk_paged.chunk_isa(head_dim) == isa
    pool, tables, starts, q, k, v = make_batch(
        cached, rows, kvh, group, block_size, head_dim, dtype, seed=sum(cached) + len(rows)
    )
    scale = head_dim**-0.5
    num_cached = torch.tensor(cached)
    out, lse = chunk_paged.chunk_attention_paged_batch(
        q, k, v, pool, tables, starts, num_cached, scale, window
    )
    want_out, want_lse = reference(pool, tables, starts, cached, q, k, v, scale, window)
    assert out.dtype == dtype and out.shape == want_out.shape
    bf16_dots = isa in BF16_DOT_ISAS and dtype == torch.bfloat16
    torch.testing.assert_close(
        lse, want_lse, **(BF16_DOT_LSE_TOL if bf16_dots else {"atol": 1e-4, "rtol": 0.0})
    )
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.float(), want_out, **tol)


@pytest.mark.kernel_variant("chunk_paged")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 24], ids=["full", "window24"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_ragged_batch_matches_reference(
    isas, monkeypatch, dtype, window, group, head_dim, block_size
):
    """Four sequences: nothing cached, page-unaligned, page-aligned and long caches, with
    chunks of 5 (a verification of 4 draft tokens), 1, 33 and 64 rows."""
    cached, rows = [0, 37, 64, 300], [5, 1, 33, 64]
    for isa in isas:
        check(isa, monkeypatch, cached, rows, 2, group, block_size, head_dim, dtype, window)


@pytest.mark.kernel_variant("chunk_paged")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_chunk_length_1_to_64(isas, monkeypatch, dtype):
    """One batch of 64 sequences with chunks of 1..64 rows after 0..63 * 7 held slots."""
    rows = list(range(1, 65))
    cached = [7 * i for i in range(64)]
    for isa in isas:
        check(isa, monkeypatch, cached, rows, 1, 3, 16, 64, dtype, None)


@pytest.mark.kernel_variant("chunk_paged")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_runtime_head_dim_small_pages_and_wide_groups(isas, monkeypatch, dtype, window):
    """head_dim 96 (no compile-time specialisation), pages of 8 slots (every key tile spans
    two pages, so fp32 tiles are copied rather than read in place) and a group of 6 query
    heads (items of up to 6 x 5 = 30 rows: several row vectors each; 6 x 1 rows for the
    one-row chunk)."""
    for isa in isas:
        check(isa, monkeypatch, [45, 200, 0], [5, 17, 3], 2, 6, 8, 96, dtype, window)


@pytest.mark.kernel_variant("chunk_paged")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 8])
def test_bf16_key_blocks_across_pages(isas, monkeypatch, head_dim, block_size):
    """bf16 pages smaller than a register block of keys: the blocks that span pages take the
    per-key pointers, those in one page (and the chunk's own keys) one pointer."""
    for isa in isas:
        check(
            isa, monkeypatch, [45, 300], [5, 17], 2, 3, block_size, head_dim, torch.bfloat16, None
        )


@pytest.mark.kernel_variant("chunk_paged")
@pytest.mark.parametrize(("cached", "rows", "window"), [
    ([1200, 700], [5, 3], None),
    ([1200, 700], [5, 3], 300),
    ([900], [10], None),  # 30 columns: two column tiles of the AMX item
    ([3000], [5], 1000),  # a window long enough to be cut into key splits
])  # fmt: skip
def test_rising_logits_move_the_max(isas, monkeypatch, cached, rows, window):
    """Keys whose logits rise along the cache (key j of n scaled by 1 + 15 j / n, so a row's
    max grows by far more than 2^8 within an item): the online softmax must move its max and
    rescale what it has summed, tile after tile (the AMX kernel's lazy max redoes such blocks
    the exact way), with two threads splitting the keys."""
    pool, tables, starts, q, k, v = make_batch(cached, rows, 2, 3, 16, 64, torch.bfloat16, seed=9)
    for b, n in enumerate(cached):  # scale each held key by its position
        for j in range(n):
            page, off = tables[b, j // 16], j % 16
            pool[page, 0, :, off] *= 1 + 15 * j / n
    want = reference(pool, tables, starts, cached, q, k, v, 0.125, window)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for isa in isas:
            monkeypatch.setenv(ISA_ENV, isa)
            out, lse = chunk_paged.chunk_attention_paged_batch(
                q, k, v, pool, tables, starts, torch.tensor(cached), 0.125, window
            )
            # the LSE reaches ~100 here: queries rounded to bf16 move it by up to ~2^-9 of that
            torch.testing.assert_close(lse, want[1], atol=1e-3, rtol=4e-3)
            torch.testing.assert_close(out.float(), want[0], atol=0.05, rtol=0.05)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.kernel_variant("chunk_paged")
def test_group_wider_than_an_amx_item(isas, monkeypatch):
    """34 query heads per KV head: more columns than an AMX item takes even for one row, so
    the AMX unit runs its AVX512-BF16 path (every variant checked the same)."""
    for isa in isas:
        check(isa, monkeypatch, [40, 100], [5, 2], 1, 34, 16, 64, torch.bfloat16, None)


def test_bf16_route_limit_counts_amx_row_blocks(monkeypatch):
    """Past the limit the backend gathers: 12 blocks of ``32 // group`` rows on AMX for groups
    the AMX item takes, 16 rows otherwise (or on other variants)."""
    monkeypatch.setattr(chunk_paged, "chunk_isa", lambda head_dim: "avx512_amx")
    assert [chunk_paged.bf16_max_rows(64, g) for g in (1, 3, 8, 32, 33)] == [384, 120, 48, 12, 16]
    monkeypatch.setattr(chunk_paged, "chunk_isa", lambda head_dim: "avx512_bf16")
    assert [chunk_paged.bf16_max_rows(64, g) for g in (1, 3)] == [16, 16]
    pool = torch.zeros(1, 2, 3, 16, 64, dtype=torch.bfloat16)
    assert chunk_paged.beats_gather(pool, 16, 9) and not chunk_paged.beats_gather(pool, 17, 9)
    assert chunk_paged.beats_gather(pool.float(), 1000, 9)


@pytest.mark.kernel_variant("chunk_paged")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_chunk_keys(isas, monkeypatch, dtype):
    """The chunk's own keys and values as the model hands them (``[kv_heads, m, d]`` views of
    ``[m, kv_heads, d]``: rows ``kv_heads * d`` apart), over 40 rows."""
    pool, tables, starts, q, k, v = make_batch([70], [40], 2, 3, 16, 64, dtype, seed=5)
    k_view, v_view = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k, v))
    assert k_view.stride(1) == 2 * 64
    want = reference(pool, tables, starts, [70], q, k, v, 0.125, None)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    for isa in isas:
        monkeypatch.setenv(ISA_ENV, isa)
        out, _ = chunk_paged.chunk_attention_paged_batch(
            q, k_view, v_view, pool, tables, starts, torch.tensor([70]), 0.125
        )
        torch.testing.assert_close(out.float(), want[0], **tol)


@pytest.mark.kernel_variant("chunk_paged")
@pytest.mark.parametrize("window", [None, 100])
def test_split_keys_across_threads(isas, monkeypatch, window):
    """Long caches with two threads: each (sequence, KV head) is cut into key splits merged
    by their LSE, and a large chunk (chunked prefill) into row blocks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for isa in isas:
            for dtype in (torch.float32, torch.bfloat16):  # bf16: 32-key tiles merged by LSE
                check(isa, monkeypatch, [3001, 1500], [5, 200], 2, 4, 32, 64, dtype, window)
            # few rows per item (keys in lanes), split the same way, both dtypes
            for dtype in (torch.bfloat16, torch.float32):
                check(isa, monkeypatch, [3001, 1500], [1, 2], 2, 3, 16, 64, dtype, window)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.kernel_variant("chunk_paged")
def test_single_sequence_api_and_strided_query(isas, monkeypatch):
    """``chunk_attention_paged`` of one sequence, with the model's transposed query view."""
    pool, tables, starts, q, k, v = make_batch([45], [6], 3, 3, 16, 64, torch.float32, seed=3)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # [H, m, d] view of [m, H, d]
    assert not strided.is_contiguous()
    want = reference(pool, tables, starts, [45], q, k, v, 0.125, None)
    for isa in isas:
        monkeypatch.setenv(ISA_ENV, isa)
        out, lse = chunk_paged.chunk_attention_paged(strided, k, v, pool, tables[0], 45, 0.125)
        torch.testing.assert_close(out, want[0], **FP32_TOL)
        torch.testing.assert_close(lse, want[1], **FP32_TOL)


@pytest.mark.kernel_variant("chunk_paged")
def test_named_variant_runs_that_variant(isas, monkeypatch):
    """``isa=`` (benchmarks) runs the variant it names, bit for bit as when it is forced."""
    pool, tables, starts, q, k, v = make_batch([70], [5], 3, 3, 16, 64, torch.bfloat16, seed=4)
    cached = torch.tensor([70])
    for isa in isas:
        named = chunk_paged.chunk_attention_paged_batch(
            q, k, v, pool, tables, starts, cached, 0.125, isa=isa
        )
        monkeypatch.setenv(ISA_ENV, isa)
        forced = chunk_paged.chunk_attention_paged_batch(
            q, k, v, pool, tables, starts, cached, 0.125
        )
        monkeypatch.delenv(ISA_ENV)
        assert torch.equal(named[0], forced[0]) and torch.equal(named[1], forced[1])
    with pytest.raises(RuntimeError, match="no chunk kernel variant 'sse9'"):
        chunk_paged.chunk_attention_paged_batch(
            q, k, v, pool, tables, starts, cached, 0.125, isa="sse9"
        )


def test_the_variant_is_resolved_once_per_step_scope(isas, monkeypatch):
    """Inside a step's native scope (every forward runs in one) the setting read on entry
    holds; outside it the environment is read per call."""
    fastest, lowest = isas[0], isas[-1]
    monkeypatch.setenv(ISA_ENV, lowest)
    with native_ops.native_scope():
        assert chunk_paged.chunk_isa(64) == lowest
        monkeypatch.setenv(ISA_ENV, fastest)
        assert chunk_paged.chunk_isa(64) == lowest
    assert chunk_paged.chunk_isa(64) == fastest


@pytest.mark.kernel_variant("chunk_paged")
def test_rejects_page_ids_out_of_range(isas):
    pool, tables, starts, q, k, v = make_batch([40], [3], 1, 2, 16, 64, torch.float32)
    tables[0, 1] = pool.shape[0]
    with pytest.raises(RuntimeError, match="page id out of range"):
        chunk_paged.chunk_attention_paged_batch(
            q, k, v, pool, tables, starts, torch.tensor([40]), 0.125
        )


def test_supports_only_what_the_kernel_takes():
    pool = torch.zeros(4, 2, 2, 16, 64)
    query, key = torch.zeros(4, 3, 64), torch.zeros(2, 3, 64)
    native = not build.native_disabled() and build.load_extension() is not None
    assert chunk_paged.supports_chunk_paged(query, key, pool) is native
    assert not chunk_paged.supports_chunk_paged(query, key, pool, logit_softcap=30.0)
    assert not chunk_paged.supports_chunk_paged(query.half(), key, pool)
    assert not chunk_paged.supports_chunk_paged(torch.zeros(3, 3, 64), key, pool)  # 3 % 2
    assert not chunk_paged.supports_chunk_paged(query, key, pool.transpose(3, 4))


@pytest.mark.kernel_variant("chunk_paged")
@pytest.mark.parametrize(("dtype", "extra_rows", "native"), [
    (torch.bfloat16, 0, True), (torch.bfloat16, 1, False), (torch.float32, 200, True)
])  # fmt: skip
def test_backend_routes_long_bf16_chunks_to_the_gather(
    isas, monkeypatch, dtype, extra_rows, native
):
    """``CpuNativeBackend`` runs the kernel where it is the faster route: every chunk over fp32
    pages, chunks of up to ``bf16_max_rows`` rows over bf16 pages; same results either way."""
    limit = chunk_paged.bf16_max_rows(64, 2)
    rows = limit + extra_rows
    calls = []
    kernel = chunk_paged.chunk_attention_paged_batch
    monkeypatch.setattr(
        chunk_paged,
        "chunk_attention_paged_batch",
        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs),
    )
    pool, tables, starts, q, k, v = make_batch([50], [rows], 1, 2, 16, 64, dtype, seed=rows)
    out, lse = CpuNativeBackend().prefill_attention_paged(q, k, v, pool, tables[0], 50, 0.125)
    want = reference(pool, tables, starts, [50], q, k, v, 0.125, None)
    assert len(calls) == int(native)
    bf16_dots = native and dtype == torch.bfloat16 and chunk_paged.chunk_isa(64) in BF16_DOT_ISAS
    torch.testing.assert_close(
        lse, want[1], **(BF16_DOT_LSE_TOL if bf16_dots else {"atol": 1e-4, "rtol": 0.0})
    )
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.float(), want[0], **tol)
