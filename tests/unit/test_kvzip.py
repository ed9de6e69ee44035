"""KVzip scoring against a brute-force float64 reference, the ``max`` window reduction on every
backend, and the reconstruction segments' framing.

Reference: per reconstruction segment the full softmax matrix of [held slots + segment rows]
(causal), the largest probability any segment row of a query head puts on each held slot,
max over segments, the group's query heads combined by max or mean, max-pooled over the slots
within ``kernel_size // 2``, sinks kept; kept sets compared with ties to the newer slot.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.attention.backends.cpu_native import CpuNativeBackend
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.attention.torch_ref import attention_mass_per_head
from sparsekv.compression import LayerView
from sparsekv.compression.base import ReconstructionRows
from sparsekv.compression.kvzip import KVzipCompressor, RepeatPrompt, repeat_prompt
from tests.unit.test_compression import ref_keep, ref_pool

HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5


def causal_probs(queries, keys):
    """``[H, m, T]`` float64 softmax of the last ``m`` of ``T`` positions (causal)."""
    num_heads, m, _ = queries.shape
    group = num_heads // keys.shape[0]
    logits = queries.double() @ keys.double().repeat_interleave(group, 0).transpose(1, 2) * SCALE
    total = keys.shape[1]
    visible = torch.arange(total)[None, :] <= (total - m + torch.arange(m))[:, None]
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)


def make_view(num_kv_heads, group, n, segment_lengths, seed=0, with_lse=True, backend=None):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_kv_heads, n, HEAD_DIM, generator=gen) * 2
    window = torch.randn(num_kv_heads * group, 4, HEAD_DIM, generator=gen)
    segments = []
    for m in segment_lengths:
        q = torch.randn(num_kv_heads * group, m, HEAD_DIM, generator=gen) * 2
        k = torch.randn(num_kv_heads, m, HEAD_DIM, generator=gen)
        lse = None
        if with_lse:
            every = torch.cat([keys, k], dim=1).repeat_interleave(group, 0)
            logits = q @ every.transpose(1, 2) * SCALE
            visible = torch.arange(n + m)[None, :] <= (n + torch.arange(m))[:, None]
            lse = torch.logsumexp(logits.masked_fill(~visible, float("-inf")), dim=-1)
        segments.append(ReconstructionRows(q, k, lse))
    view = LayerView(
        keys=keys,
        values=keys.clone(),
        window_queries=window,
        window_lse=None,
        scale=SCALE,
        backend=backend,
        reconstruction=tuple(segments),
    )
    return view


def reference_scores(view, sinks, kernel_size=1, gqa_agg="max"):
    n, num_kv_heads = view.num_tokens, view.num_kv_heads
    best = torch.zeros(view.reconstruction[0].queries.shape[0], n, dtype=torch.float64)
    for segment in view.reconstruction:
        probs = causal_probs(segment.queries, torch.cat([view.keys, segment.keys], dim=1))
        best = torch.maximum(best, probs[:, :, :n].amax(dim=1))
    grouped = best.reshape(num_kv_heads, -1, n)
    best = grouped.amax(dim=1) if gqa_agg == "max" else grouped.mean(dim=1)
    pooled = ref_pool(best, "max", kernel_size)
    pooled[:, :sinks] = float("inf")
    return pooled


@pytest.mark.parametrize("backend", [None, TorchBackend(), CpuNativeBackend()])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("segments", [(40,), (17, 30, 5)])
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("kernel_size", [1, 15])
@pytest.mark.parametrize("gqa_agg", ["max", "mean"])
def test_kept_slots_equal_the_brute_force_reference(
    backend, group, segments, with_lse, kernel_size, gqa_agg
):
    view = make_view(2, group, 90, segments, seed=group, with_lse=with_lse, backend=backend)
    pooling = "max" if kernel_size > 1 else "none"
    compressor = KVzipCompressor(
        window=4, pooling=pooling, kernel_size=kernel_size, gqa_agg=gqa_agg
    )
    expected = reference_scores(view, compressor.sinks, kernel_size, gqa_agg)
    torch.testing.assert_close(compressor.score(view).double(), expected, atol=1e-6, rtol=1e-5)
    kept = compressor.select(view, 30, 4)
    for head in range(view.num_kv_heads):
        assert kept[head].tolist() == ref_keep(expected[head], 90, 30, 4), head


def test_equal_scores_tie_to_the_newer_slot():
    # Identical keys: every held slot gets the same probability from every row.
    keys = torch.ones(1, 20, HEAD_DIM)
    segment = ReconstructionRows(torch.ones(2, 6, HEAD_DIM), torch.ones(1, 6, HEAD_DIM), None)
    view = LayerView(
        keys, keys, keys.repeat(2, 1, 1)[:, -4:], None, SCALE, reconstruction=(segment,)
    )
    kept = KVzipCompressor(window=4, sinks=2, gqa_agg="max").select(view, 10, 4)
    assert kept.tolist() == [[0, 1, 12, 13, 14, 15, 16, 17, 18, 19]]


def test_without_reconstruction_rows_the_window_queries_score():
    view = make_view(2, 2, 50, (), seed=3)
    scores = KVzipCompressor(window=4, pooling="none", sinks=0, gqa_agg="max").score(view)
    probs = causal_probs(view.window_queries, view.keys)
    expected = probs.amax(dim=1).reshape(2, 2, 50).amax(dim=1)
    torch.testing.assert_close(scores.double(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", [TorchBackend(), CpuNativeBackend()], ids=["torch", "cpu"])
def test_window_scores_max_reduction(backend):
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 70, HEAD_DIM, generator=gen)
    queries = torch.randn(4, 30, HEAD_DIM, generator=gen)
    want = causal_probs(queries, keys).amax(dim=1)
    got = backend.window_scores(keys, queries, None, SCALE, reduce="max")
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-5)
    # Chunked over rows (two rows per chunk) gives the same maxima.
    chunked = attention_mass_per_head(
        keys, queries, None, SCALE, max_chunk_elements=600, reduce="max"
    )
    torch.testing.assert_close(chunked.double(), want, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="reduce"):
        backend.window_scores(keys, queries, None, SCALE, reduce="mean")


def test_segments_frame_each_chunk():
    repeat = RepeatPrompt(first=(1, 2), later=(3,), suffix=(9,), template_prefix=(7, 7))
    compressor = KVzipCompressor(chunk_size=4, prev_tokens=2, repeat=repeat)
    context = [7, 7] + list(range(100, 110))
    assert compressor.reconstruction_segments(context) == [
        [1, 2, 9, 100, 101, 102, 103],
        [3, 102, 103, 9, 104, 105, 106, 107],
        [3, 106, 107, 9, 108, 109],
    ]
    # A context without the template prefix is reconstructed whole; none without framing.
    assert compressor.reconstruction_segments([5, 6]) == [[1, 2, 9, 5, 6]]
    assert KVzipCompressor().reconstruction_segments([5, 6, 7]) == [[5, 6, 7]]


def test_repeat_prompt_of_the_chat_template(smollm2_tokenizer):
    repeat = repeat_prompt(smollm2_tokenizer)
    decode = smollm2_tokenizer.decode
    assert decode(list(repeat.first)) == "\n\nRepeat the previous context exactly."
    assert decode(list(repeat.suffix)) == "<|im_end|>\n<|im_start|>assistant\n"
    assert decode(list(repeat.template_prefix)).endswith("<|im_start|>user\n")
