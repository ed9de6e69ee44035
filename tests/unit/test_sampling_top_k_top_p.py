"""Top-k / top-p over candidates agree with the full-sort reference, ties included."""

from __future__ import annotations

import pytest
import torch

from sparsekv.sampling.top_k_top_p import NUM_CANDIDATES, apply_top_k_top_p, truncate_sorted

VOCAB = 5000
TOP_K = [0, 1, 5, 50, NUM_CANDIDATES - 1, NUM_CANDIDATES, 3000, VOCAB, -1]
TOP_P = [1.0, 0.5, 0.9, 0.999, 1e-6]


def reference(logits, top_k, top_p):
    vocab_size = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
    p = torch.where(top_p < 1.0, top_p, float("inf"))
    return truncate_sorted(logits, k, p)


@pytest.mark.parametrize(
    "kind", ["peaked", "flat", "quantized_ties", "tied_at_the_candidate_boundary", "small_vocab"]
)
def test_candidates_match_full_sort(kind):
    g = torch.Generator().manual_seed(0)
    rows = len(TOP_K) * len(TOP_P)
    vocab = 300 if kind == "small_vocab" else VOCAB
    logits = torch.randn(rows, vocab, generator=g) * (0.01 if kind == "flat" else 4.0)
    if kind == "quantized_ties":
        logits = logits.round()  # a few dozen distinct values: ties everywhere
    if kind == "tied_at_the_candidate_boundary":
        # Ranks C-10 .. C+9 share one value, so topk's candidates cut the tie group.
        ranked, order = logits.sort(dim=-1, descending=True)
        group = order[:, NUM_CANDIDATES - 10 : NUM_CANDIDATES + 10]
        logits.scatter_(1, group, ranked[:, NUM_CANDIDATES - 10 :][:, :1].expand(-1, 20))
    top_k = torch.tensor([k for k in TOP_K for _ in TOP_P])
    top_p = torch.tensor([p for _ in TOP_K for p in TOP_P])
    got = apply_top_k_top_p(logits, top_k, top_p)
    want = reference(logits, top_k, top_p)
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    assert torch.equal(got[got > float("-inf")], logits[got > float("-inf")])


def test_ties_keep_the_lowest_ids():
    logits = torch.zeros(2, VOCAB)
    logits[:, 4000] = 1.0
    got = apply_top_k_top_p(logits, torch.tensor([3, 0]), torch.tensor([1.0, 1.0]))
    assert (got[0] > float("-inf")).nonzero().squeeze(1).tolist() == [0, 1, 4000]
    assert torch.equal(got[1], logits[1])


def test_row_result_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, VOCAB, generator=g) * 2
    top_k = torch.tensor([0, 40, 2000, 0, 7, 0])
    top_p = torch.tensor([0.9, 1.0, 0.95, 1.0, 0.3, 0.999])
    batched = apply_top_k_top_p(logits, top_k, top_p)
    for row in range(6):
        alone = apply_top_k_top_p(logits[row : row + 1], top_k[row : row + 1], top_p[row : row + 1])
        assert torch.equal(alone[0], batched[row])
