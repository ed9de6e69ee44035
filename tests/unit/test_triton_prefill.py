"""Triton prefill attention with LSE and window scores against the PyTorch references
(interpreted on CPU tensors; on a GPU with ``SPARSEKV_TEST_DEVICE=cuda``, where PyTorch's
flash kernel is checked too): whole prompts and chunks (queries are the last keys), GQA,
sliding window, soft-cap; chunks whose earlier keys are read from pages in place; window
scores over paged keys (one or several layers' tables) and
dense keys, with the LSE given or computed.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention import torch_ref
from tests import triton_kernels
from tests.triton_kernels import DEVICE, DTYPES, tolerance, triton_mode  # noqa: F401

kernels = triton_kernels.load()

# (num_heads, num_kv_heads, num_queries, num_keys, head_dim, sliding_window, logit_softcap)
PREFILL_CASES = [
    (4, 2, 20, 20, 64, None, None),  # a whole prompt
    (3, 1, 7, 40, 96, None, None),  # a chunk after 33 cached keys
    (4, 4, 1, 1, 128, None, None),  # one token
    (2, 1, 18, 50, 64, 9, None),  # a chunk under a sliding window
    (2, 2, 33, 33, 32, None, 2.0),  # soft-cap
    (8, 2, 5, 37, 256, 16, 30.0),
]
PREFILL_PARAMS = [
    pytest.param(
        *case, dtype, id=f"h{case[0]}-kv{case[1]}-q{case[2]}-k{case[3]}-d{case[4]}-{dtype}"
    )
    for dtype in DTYPES
    for case in PREFILL_CASES
    if dtype == torch.float32 or case[4] != 256
]


def random_qkv(num_heads, num_kv_heads, num_queries, num_keys, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(num_heads, num_queries, head_dim, generator=gen)
    key = torch.randn(num_kv_heads, num_keys, head_dim, generator=gen)
    value = torch.randn(num_kv_heads, num_keys, head_dim, generator=gen)
    return query.to(dtype), key.to(dtype), value.to(dtype)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "queries", "keys", "head_dim", "window", "softcap", "dtype"),
    PREFILL_PARAMS,
)
def test_prefill_matches_reference(
    heads, kv_heads, queries, keys, head_dim, window, softcap, dtype
):
    query, key, value = random_qkv(heads, kv_heads, queries, keys, head_dim, dtype)
    expected_out, expected_lse = torch_ref.attention_with_lse(
        query.float(), key.float(), value.float(), 0.1, window, softcap
    )
    paths = [False]
    if kernels.prefill.flash_applies(query.to(DEVICE), key.to(DEVICE), softcap):
        paths.append(True)  # CUDA only
    for use_flash in paths:
        out, lse = kernels.prefill.attention_with_lse(
            query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), 0.1, window, softcap, use_flash
        )
        assert out.dtype == dtype and lse.dtype == torch.float32
        torch.testing.assert_close(out.cpu().float(), expected_out, **tolerance(dtype))
        torch.testing.assert_close(lse.cpu(), expected_lse, **tolerance(dtype))


def test_prefill_rejects_more_queries_than_keys_and_flash_on_cpu():
    query, key, value = random_qkv(2, 1, 5, 4, 32, torch.float32)
    with pytest.raises(ValueError, match="causal"):
        kernels.prefill.attention_with_lse(query, key, value, 0.1)
    if DEVICE.type == "cpu":
        query, key, value = random_qkv(2, 1, 4, 4, 32, torch.float32)
        with pytest.raises(ValueError, match="use_flash"):
            kernels.prefill.attention_with_lse(query, key, value, 0.1, use_flash=True)


def reference_window_scores(queries, keys, lse, scale, softcap=None):
    """The dense fp32 definition: ``sum_i exp(l_ij - lse_i)`` over window rows that see slot
    ``j``; ``lse`` computed over those slots when not given."""
    keys = keys.float().repeat_interleave(queries.shape[0] // keys.shape[0], dim=0)
    logits = torch.matmul(queries.float(), keys.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    visible = torch_ref.causal_mask(queries.shape[1], keys.shape[1])
    logits = logits.masked_fill(~visible, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse[..., None]).sum(dim=1), lse


# (num_heads, num_kv_heads, head_dim, block_size, num_slots, window, lse given, layers)
WINDOW_CASES = [
    (4, 2, 64, 16, 45, 8, True, 1),
    (4, 2, 64, 16, 45, 8, False, 1),
    (3, 3, 96, 32, 70, 16, False, 1),
    (6, 2, 128, 16, 16, 16, True, 1),  # the window is every slot
    (2, 1, 64, 16, 40, 8, False, 3),  # three layers' tables at once
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "num_slots", "window", "given", "layers"),
    WINDOW_CASES,
)
@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_window_scores_paged_match_reference(
    heads, kv_heads, head_dim, block_size, num_slots, window, given, layers, dtype
):
    gen = torch.Generator().manual_seed(7)
    num_blocks = -(-num_slots // block_size)
    num_pages = layers * num_blocks + 3
    pool = torch.randn(num_pages, 2, kv_heads, block_size, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_pages, generator=gen)[: layers * num_blocks].view(layers, -1)
    queries = torch.randn(layers * heads, window, head_dim, generator=gen).to(dtype)
    expected, lses = [], []
    for layer in range(layers):
        keys, _ = torch_ref.gather_kv(pool.float(), tables[layer], num_slots)
        rows = queries[layer * heads : (layer + 1) * heads]
        scores, lse = reference_window_scores(rows, keys, None, 0.1)
        expected.append(scores)
        lses.append(lse)
    expected, lse = torch.cat(expected), torch.cat(lses)
    scores, got_lse = kernels.window_scores.window_scores_paged(
        queries.to(DEVICE),
        lse.to(DEVICE) if given else None,
        pool.to(DEVICE),
        (tables[0] if layers == 1 else tables).to(DEVICE),
        num_slots,
        0.1,
    )
    assert scores.dtype == torch.float32 and scores.shape == (layers * heads, num_slots)
    torch.testing.assert_close(scores.cpu(), expected, **tolerance(dtype))
    torch.testing.assert_close(got_lse.cpu(), lse, **tolerance(dtype))


@pytest.mark.parametrize(("given", "softcap"), [(True, None), (False, 3.0)])
def test_window_scores_dense_match_reference(given, softcap):
    gen = torch.Generator().manual_seed(8)
    keys = torch.randn(2, 37, 64, generator=gen)
    queries = torch.randn(4, 6, 64, generator=gen)
    expected, lse = reference_window_scores(queries, keys, None, 0.1, softcap)
    scores, got_lse = kernels.window_scores.window_scores_dense(
        queries.to(DEVICE), keys.to(DEVICE), lse.to(DEVICE) if given else None, 0.1, softcap
    )
    torch.testing.assert_close(scores.cpu(), expected, **tolerance(torch.float32))
    torch.testing.assert_close(got_lse.cpu(), lse, **tolerance(torch.float32))


def test_window_scores_reject_a_window_past_the_slots():
    pool = torch.zeros(2, 2, 1, 16, 32, device=DEVICE)
    with pytest.raises(ValueError, match="window_queries"):
        kernels.window_scores.window_scores_paged(
            torch.zeros(2, 9, 32, device=DEVICE),
            None,
            pool,
            torch.tensor([0], device=DEVICE),
            8,
            0.1,
        )


# (num_heads, num_kv_heads, cached slots, chunk length, head_dim, block_size, window, soft-cap)
CHUNK_CASES = [
    (4, 2, 37, 20, 64, 16, None, None),
    (2, 1, 40, 18, 64, 32, 9, None),  # the window starts inside the pages
    (3, 3, 0, 7, 32, 16, None, 2.0),
]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "cached", "length", "head_dim", "block_size", "window", "softcap"),
    CHUNK_CASES,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_from_pages_matches_reference(
    heads, kv_heads, cached, length, head_dim, block_size, window, softcap, dtype
):
    """Earlier keys read from shuffled pages, the chunk's own dense: the reference over the
    gathered ``cached ++ chunk`` keys."""
    gen = torch.Generator().manual_seed(11)
    num_blocks = -(-cached // block_size)
    pool = torch.randn(num_blocks + 3, 2, kv_heads, block_size, head_dim, generator=gen)
    table = torch.randperm(num_blocks + 3, generator=gen)[: max(num_blocks, 1)]
    query, key, value = random_qkv(heads, kv_heads, length, length, head_dim, dtype, seed=12)
    pool = pool.to(dtype)
    cached_k, cached_v = torch_ref.gather_kv(pool.float(), table[:num_blocks], cached)
    expected_out, expected_lse = torch_ref.attention_with_lse(
        query.float(),
        torch.cat([cached_k, key.float()], 1),
        torch.cat([cached_v, value.float()], 1),
        0.1,
        window,
        softcap,
    )
    out, lse = kernels.prefill_paged.chunk_attention_paged(
        *(t.to(DEVICE) for t in (query, key, value, pool, table)), cached, 0.1, window, softcap
    )
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.cpu().float(), expected_out, **tolerance(dtype))
    torch.testing.assert_close(lse.cpu(), expected_lse, **tolerance(dtype))


def test_chunk_from_pages_rejects_a_short_table_and_bad_shapes():
    pool = torch.zeros(4, 2, 1, 16, 32, device=DEVICE)
    query, key, value = random_qkv(2, 1, 3, 3, 32, torch.float32)
    query, key, value = query.to(DEVICE), key.to(DEVICE), value.to(DEVICE)
    with pytest.raises(ValueError, match="block_table"):
        kernels.prefill_paged.chunk_attention_paged(
            query, key, value, pool, torch.tensor([0], device=DEVICE), 17, 0.1
        )
    with pytest.raises(ValueError, match="chunk attention"):
        kernels.prefill_paged.chunk_attention_paged(
            query, key[:, :2], value[:, :2], pool, torch.tensor([0], device=DEVICE), 4, 0.1
        )
