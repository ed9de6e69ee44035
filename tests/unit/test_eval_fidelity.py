"""Greedy agreement and KL (teacher-forced, vs the full cache) on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from sparsekv.evaluation.fidelity import (
    FidelityResult,
    fidelity,
    greedy_agreement,
    kl_per_position,
    mean_kl,
)


def test_identical_logits_agree_fully_with_zero_kl():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 5
    tokens = logits.argmax(-1)
    assert greedy_agreement(tokens, logits) == 1.0
    assert mean_kl(logits, logits) == 0.0
    assert fidelity(tokens, logits, logits) == FidelityResult(1.0, 0.0, 64, None)


def test_agreement_counts_argmax_matches():
    logits = torch.zeros(64, 10)
    logits[:, 3] = 1.0
    tokens = torch.full((64,), 3)
    tokens[[5, 20, 40, 63]] = 7
    assert greedy_agreement(tokens, logits) == pytest.approx(60 / 64)
    result = fidelity(tokens.tolist(), logits, logits)
    assert result.first_divergence == 5
    assert result.num_positions == 64


def test_kl_matches_hand_computation():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3).
    full = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    compressed = torch.tensor([[0.0, math.log(3.0)], [5.0, 5.0]], dtype=torch.float64)
    expected = [0.5 * math.log(4 / 3), 0.0]
    assert kl_per_position(full, compressed).tolist() == pytest.approx(expected, abs=1e-12)
    assert mean_kl(full, compressed) == pytest.approx(0.25 * math.log(4 / 3), abs=1e-12)
    # KL is not symmetric: KL(q || p) = 1/4 ln(1/2) + 3/4 ln(3/2).
    assert mean_kl(compressed[:1], full[:1]) == pytest.approx(
        0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-12
    )


def test_kl_handles_masked_and_huge_logits():
    full = torch.tensor([[0.0, -math.inf]])  # p = (1, 0)
    assert mean_kl(full, torch.zeros(1, 2)) == pytest.approx(math.log(2.0), abs=1e-12)
    big = torch.tensor([[3e4, 0.0, -3e4]], dtype=torch.bfloat16)
    assert math.isfinite(mean_kl(big, big.flip(-1)))
    shifted = big.float() + 1000.0
    assert mean_kl(big, shifted) == pytest.approx(0.0, abs=1e-9)


def test_kl_agrees_with_torch_kl_div():
    gen = torch.Generator().manual_seed(1)
    full, comp = torch.randn(64, 300, generator=gen), torch.randn(64, 300, generator=gen)
    reference = torch.nn.functional.kl_div(
        comp.double().log_softmax(-1),
        full.double().log_softmax(-1),
        log_target=True,
        reduction="batchmean",
    )
    assert mean_kl(full, comp) == pytest.approx(reference.item(), rel=1e-10)


def test_shape_errors():
    with pytest.raises(ValueError, match="positions"):
        greedy_agreement(torch.zeros(3, dtype=torch.long), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="differ"):
        mean_kl(torch.zeros(4, 5), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="vocab_size"):
        mean_kl(torch.zeros(5), torch.zeros(5))
    with pytest.raises(ValueError, match="vocab_size"):
        greedy_agreement([], torch.zeros(0, 5))
