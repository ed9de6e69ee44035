"""Every attention backend against the PyTorch oracle on the same cases (fp32, 1e-5), and the
selection of the backend at engine start (``attention.backends.create_backend``).

The oracles are independent of the backend under test: ``torch_ref`` for attention, gathered
copies for the page writes and moves, dense definitions for the window scores.
"""

from __future__ import annotations

import sys

import pytest
import torch

from sparsekv.attention import reference, selection, torch_ref
from sparsekv.attention.backends import DecodeParams, backend_class, create_backend
from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.attention.cpu import build, chunk_paged
from sparsekv.kv_cache import quant
from tests import triton_kernels
from tests.triton_kernels import triton_mode  # noqa: F401 (the interpreter around each test)

TOL = {"atol": 1e-5, "rtol": 0.0}
BACKENDS = [TorchBackend(), CpuNativeBackend(), triton_kernels.backend()]
IDS = [backend.name for backend in BACKENDS]
each_backend = pytest.mark.parametrize("backend", BACKENDS, ids=IDS)


def make_pool(lengths, num_kv_heads, block_size, head_dim, seed=0, first_blocks=None):
    """A shuffled pool holding one request per length: (pool, tables, seq_lens, first_slots)."""
    g = torch.Generator().manual_seed(seed)
    first_blocks = first_blocks or [0] * len(lengths)
    held = [n - f * block_size for n, f in zip(lengths, first_blocks)]
    blocks = [-(-h // block_size) for h in held]
    num_pages = sum(blocks) + 3
    pool = torch.randn(num_pages, 2, num_kv_heads, block_size, head_dim, generator=g)
    order = torch.randperm(num_pages, generator=g).tolist()
    width = max(blocks)
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    first = torch.tensor([f * block_size for f in first_blocks])
    return pool, tables, torch.tensor(lengths), first


@each_backend
@pytest.mark.parametrize(
    ("group", "head_dim", "block_size"),
    [(1, 64, 16), (2, 128, 32), (3, 64, 16), (4, 96, 16), (7, 64, 32), (8, 256, 16)],
)
def test_paged_decode_equals_reference(backend, group, head_dim, block_size):
    lengths = [1, 15, 16, 17, 100, 203]
    pool, tables, lens, _ = make_pool(lengths, 2, block_size, head_dim, seed=group)
    query = torch.randn(len(lengths), 2 * group, head_dim)
    params = DecodeParams(tables, lens, head_dim**-0.5, return_attn_mass=True)
    got = backend.paged_decode(query, pool, params)
    want = torch_ref.paged_decode_attention(query, pool, tables, lens, head_dim**-0.5, None, None, None, True)  # fmt: skip
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


@each_backend
@pytest.mark.parametrize(
    ("window", "softcap"), [(None, 30.0), (40, None), (40, 20.0)], ids=["softcap", "window", "both"]
)
def test_paged_decode_sliding_first_slot_and_softcap(backend, window, softcap):
    lengths = [70, 33, 129]
    pool, tables, lens, first = make_pool(lengths, 2, 16, 64, seed=5, first_blocks=[2, 0, 5])
    query = torch.randn(3, 6, 64)
    params = DecodeParams(tables, lens, 0.125, first, window, softcap, return_attn_mass=True)
    got = backend.paged_decode(query, pool, params)
    want = torch_ref.paged_decode_attention(
        query, pool, tables, lens, 0.125, first, window, softcap, True
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


@each_backend
def test_paged_decode_empty_batch(backend):
    pool, tables, lens, _ = make_pool([3], 2, 16, 64)
    params = DecodeParams(tables[:0], lens[:0], 0.125, return_attn_mass=True)
    out, lse, mass = backend.paged_decode(torch.randn(0, 4, 64), pool, params)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4) and mass.shape == (0, 2, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_attention_with_no_queries(dtype):
    # PyTorch's CPU flash op dies with SIGFPE on zero query rows: the reference returns the
    # empty out and lse itself.
    query = torch.randn(9, 0, 64, dtype=dtype)
    key, value = torch.randn(3, 10, 64, dtype=dtype), torch.randn(3, 10, 32, dtype=dtype)
    out, lse = torch_ref.attention_with_lse(query, key, value, 0.125)
    assert out.shape == (9, 0, 32) and out.dtype == dtype  # the values' width
    assert lse.shape == (9, 0) and lse.dtype == torch.float32


@each_backend
def test_paged_decode_padding_rows_are_zero(backend):
    """Rows that see no slot (``seq_lens == first_slots``: batch padding) give a zero output,
    LSE ``-inf`` and no mass, beside real rows that are unaffected."""
    pool, tables, lens, first = make_pool([20, 33, 16, 1], 2, 16, 64, first_blocks=[1, 0, 1, 0])
    query = torch.randn(4, 4, 64)
    params = DecodeParams(tables, lens, 0.125, first, return_attn_mass=True)
    out, lse, mass = backend.paged_decode(query, pool, params)
    real = torch.tensor([True, True, False, True])
    assert torch.equal(out[2], torch.zeros(4, 64)) and torch.isneginf(lse[2]).all()
    assert not mass[2].any()
    want = torch_ref.paged_decode_attention(
        query[real], pool, tables[real], lens[real], 0.125, first[real], None, None, True
    )
    for a, b in zip((out[real], lse[real], mass[real]), want):
        torch.testing.assert_close(a, b, **TOL)


# (format, group, block_size, lengths, first blocks, window, soft-cap, mass)
QUANT_CASES = [
    ("int8", 1, 16, [1, 17, 50], [0, 0, 0], None, None, False),
    ("fp8", 4, 16, [1, 17, 50], [0, 0, 0], None, None, True),
    ("int8", 3, 32, [70, 33, 64], [1, 0, 2], 40, 20.0, True),
    ("fp8", 7, 32, [70, 9, 64], [1, 0, 2], None, 30.0, False),
    ("int8", 2, 16, [48, 5], [3, 0], 12, None, True),  # the first row is padding
]


@each_backend
@pytest.mark.parametrize(
    ("fmt", "group", "block_size", "lengths", "first_blocks", "window", "softcap", "mass"),
    QUANT_CASES,
)
def test_quantized_decode_equals_dequantized_reference(
    backend, fmt, group, block_size, lengths, first_blocks, window, softcap, mass
):
    """int8 / fp8 pages read in place equal the reference over the dequantized pool; the
    native and Triton backends must take the pages themselves (no fallback)."""
    pool, tables, lens, first = make_pool(
        lengths, 2, block_size, 64, seed=9, first_blocks=first_blocks
    )
    to_codes = quant.quantize_int8 if fmt == "int8" else quant.quantize_fp8
    codes, scales = to_codes(pool)
    query = torch.randn(len(lengths), 2 * group, 64)
    params = DecodeParams(tables, lens, 0.125, first, window, softcap, mass)
    want = torch_ref.paged_decode_attention(
        query, reference.dequantize_pool(codes, scales), *params.kernel_args()
    )
    assert backend.supports_quantized_decode(query, codes, scales) == (backend.name != "torch")
    got = backend.paged_decode_quantized(query, codes, scales, params)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, **TOL)


@each_backend
@pytest.mark.parametrize("num_queries", [1, 37, 120])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (24, None), (None, 25.0)])
def test_prefill_chunk_equals_reference(backend, num_queries, window, softcap):
    query = torch.randn(6, num_queries, 64)
    key, value = torch.randn(2, 120, 64), torch.randn(2, 120, 64)
    out, lse = backend.prefill_attention(query, key, value, 0.125, window, softcap)
    want_out, want_lse = torch_ref.attention_with_lse(query, key, value, 0.125, window, softcap)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)


# (group, head_dim, block_size, cached slots, chunk length, window, soft-cap)
CHUNK_CASES = [
    (2, 64, 16, 37, 20, None, None),  # page-unaligned cache
    (1, 64, 16, 0, 9, None, None),  # the first chunk: nothing cached
    (3, 96, 32, 64, 17, 24, None),  # a window reaching back into the pages
    (4, 128, 16, 16, 1, None, 5.0),  # one query, soft-cap
    (7, 64, 32, 50, 6, 8, 20.0),  # a window inside the chunk
]


@each_backend
@pytest.mark.parametrize(
    ("group", "head_dim", "block_size", "cached", "length", "window", "softcap"), CHUNK_CASES
)
def test_prefill_chunk_from_pages_equals_reference(
    backend, group, head_dim, block_size, cached, length, window, softcap, monkeypatch
):
    """A chunk attending to its earlier keys in the pages plus itself equals the reference
    over the gathered keys ``cached ++ chunk`` (out and LSE); the cpu backend runs its native
    chunk kernel (``chunk_paged``) on every case without soft-cap."""
    calls = []
    native_chunk = chunk_paged.chunk_attention_paged_batch
    monkeypatch.setattr(
        chunk_paged,
        "chunk_attention_paged_batch",
        lambda *args, **kwargs: calls.append(args[4].shape) or native_chunk(*args, **kwargs),
    )
    pool, tables, _, _ = make_pool([max(cached, 1)], 1, block_size, head_dim, seed=cached)
    g = torch.Generator().manual_seed(length)
    query = torch.randn(group, length, head_dim, generator=g)
    key, value = torch.randn(2, 1, length, head_dim, generator=g)
    cached_k, cached_v = torch_ref.gather_kv(pool, tables[0], cached)
    want = torch_ref.attention_with_lse(
        query,
        torch.cat([cached_k, key], 1),
        torch.cat([cached_v, value], 1),
        0.125,
        window,
        softcap,
    )
    got = backend.prefill_attention_paged(
        query, key, value, pool, tables[0], cached, 0.125, window, softcap
    )
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    native = isinstance(backend, CpuNativeBackend) and build.load_extension() is not None
    assert len(calls) == (1 if native and softcap is None else 0)


def _dense_window_scores(keys, queries, scale, softcap=None):
    group = queries.shape[0] // keys.shape[0]
    logits = queries @ keys.repeat_interleave(group, 0).transpose(1, 2) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    visible = torch_ref.causal_mask(queries.shape[1], keys.shape[1])
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    return probs.sum(dim=1), torch.logsumexp(logits.masked_fill(~visible, float("-inf")), -1)


@each_backend
@pytest.mark.parametrize("given_lse", [False, True])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_window_scores_dense(backend, given_lse, softcap):
    keys, queries = torch.randn(2, 77, 64), torch.randn(6, 9, 64)
    want, lse = _dense_window_scores(keys, queries, 0.125, softcap)
    got = backend.window_scores(keys, queries, lse if given_lse else None, 0.125, softcap)
    torch.testing.assert_close(got, want, **TOL)


@each_backend
@pytest.mark.parametrize("given_lse", [False, True])
def test_window_scores_paged_over_two_layers(backend, given_lse):
    pool, tables, _, _ = make_pool([83, 83], 2, 16, 64, seed=4)
    queries = torch.randn(2 * 6, 8, 64)
    wants, lses = zip(
        *(
            _dense_window_scores(torch_ref.gather_kv(pool, tables[i], 83)[0], queries[6 * i : 6 * i + 6], 0.125)
            for i in range(2)
        )
    )  # fmt: skip
    lse = torch.cat(lses)
    scores, got_lse = backend.window_scores_paged(
        queries, pool, tables, 83, lse if given_lse else None, 0.125
    )
    torch.testing.assert_close(scores, torch.cat(wants), **TOL)
    torch.testing.assert_close(got_lse, lse, **TOL)


@each_backend
def test_write_kv_scatters_into_pages(backend):
    pool = torch.zeros(6, 2, 2, 16, 64)
    slots = torch.tensor([0, 17, 95, 40])
    key, value = torch.randn(4, 2, 64), torch.randn(4, 2, 64)
    backend.write_kv(pool, slots, key, value)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(pool[slot // 16, 0, :, slot % 16], key[i])
        assert torch.equal(pool[slot // 16, 1, :, slot % 16], value[i])
    assert int((pool != 0).any(dim=-1).sum()) == 2 * 4 * 2


@each_backend
def test_write_kept_slots_equals_gathered_write(backend):
    g = torch.Generator().manual_seed(2)
    pool = torch.randn(8, 2, 3, 16, 64, generator=g)
    key, value = torch.randn(3, 50, 64, generator=g), torch.randn(3, 50, 64, generator=g)
    kept = torch.stack([torch.randperm(50, generator=g)[:21] for _ in range(3)])
    table = torch.tensor([5, 2])
    want = pool.clone()
    heads = torch.arange(3)[:, None]
    torch_ref.write_leading_slots(want, [5, 2], key[heads, kept], value[heads, kept])
    backend.write_kept_slots(pool, table, key, value, kept)
    assert torch.equal(pool, want)


@each_backend
def test_move_slots_in_place_and_to_fresh_pages(backend):
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(20, 2, 2, 16, 64, generator=g)
    source = torch.tensor([[7, 3, 11, 12], [8, 9, 1, 2]])
    kept = torch.stack([torch.randperm(60, generator=g)[:23].sort().values for _ in range(4)])
    kept = kept.view(2, 2, 23)
    heads = torch.arange(2)[:, None]
    for target in (source[:, :2], torch.tensor([[15, 16], [17, 18]])):
        moved = pool.clone()
        backend.move_slots(moved, source, target, kept)
        for layer in range(2):
            keys, values = torch_ref.gather_kv(pool, source[layer], 60)
            got_k, got_v = torch_ref.gather_kv(moved, target[layer], 23)
            assert torch.equal(got_k, keys[heads, kept[layer]])
            assert torch.equal(got_v, values[heads, kept[layer]])


@each_backend
def test_kept_indices_prefer_recent_on_ties(backend):
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    got = backend.kept_indices(scores, 3)
    assert got.tolist() == [[1, 2, 4], [3, 4, 5]]
    many = torch.randn(5, 300).round(decimals=1)
    want = selection.top_indices_prefer_recent(many, 120).sort(dim=-1).values
    assert torch.equal(backend.kept_indices(many, 120), want)


def test_auto_picks_native_on_cpu_and_the_reference_when_disabled(monkeypatch):
    assert isinstance(create_backend("auto", "cpu"), CpuNativeBackend)
    assert type(create_backend("torch", "cpu")) is TorchBackend
    monkeypatch.setenv("SPARSEKV_DISABLE_NATIVE", "1")
    assert type(create_backend("auto", "cpu")) is TorchBackend


def test_bad_backend_names_raise_value_errors():
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        create_backend("cuda_magic", "cpu")
    with pytest.raises(ValueError, match="CPU tensors only"):
        create_backend("cpu", "cuda")


def test_triton_without_triton_is_a_clear_value_error(monkeypatch):
    # ``None`` in sys.modules makes an import of that name fail, as where Triton is missing.
    monkeypatch.setitem(sys.modules, "sparsekv.attention.backends.triton_backend", None)
    with pytest.raises(ValueError, match="attention_backend 'triton' is not available"):
        backend_class("triton")
    with pytest.raises(ValueError, match="attention_backend 'triton' is not available"):
        create_backend("triton", "cpu")
