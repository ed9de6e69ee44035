"""Speculative decoding without a model: the n-gram drafter's proposals, greedy acceptance, and
rejection sampling's output distribution (it must equal the target's, whatever the drafts)."""

from __future__ import annotations

import pytest
import torch

from sparsekv.config import SpeculativeConfig
from sparsekv.engine.request import Request
from sparsekv.sampling_params import SamplingParams
from sparsekv.spec_decode import self_draft
from sparsekv.spec_decode.ngram import propose_ngram
from sparsekv.spec_decode.verify import accept_greedy, accept_sampled, verify_request

# chi-square critical value, 3 degrees of freedom, significance 1e-3
CHI2_CRITICAL_DF3 = 16.27


@pytest.mark.parametrize(
    ("tokens", "k", "min_n", "max_n", "expected"),
    [
        ([1, 2, 3, 4, 1, 2], 3, 1, 3, [3, 4, 1]),  # the 2-gram [1, 2] matched at 0
        ([1, 2, 9, 1, 2, 7, 1, 2], 2, 1, 3, [7, 1]),  # the latest earlier occurrence
        ([4, 1, 2, 9, 8, 1, 2, 7, 4, 1, 2], 2, 1, 3, [9, 8]),  # the longest n-gram first
        ([5, 5, 5], 4, 1, 3, [5]),  # clipped at the end of the sequence
        ([1, 2, 3, 4], 3, 1, 3, []),  # no earlier occurrence
        ([1, 2, 3, 1], 3, 2, 3, []),  # only a 1-gram matches, min_n = 2
        ([1, 2, 3, 1], 0, 1, 3, []),
        ([7], 3, 1, 3, []),
    ],
)
def test_ngram_proposals(tokens, k, min_n, max_n, expected):
    assert propose_ngram(tokens, k, min_n, max_n) == expected


def test_greedy_acceptance_keeps_the_matching_prefix_and_the_target_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # correction at the mismatch
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_greedy([3], []) == [3]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


P = torch.tensor(
    [[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.15, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float32
)


@pytest.mark.parametrize("drafts", [[2, 0], [3, 3], [0, 1]])
def test_rejection_sampling_emits_the_target_distribution(drafts):
    generator = torch.Generator().manual_seed(0)
    num_trials = 8000
    first = torch.zeros(4)
    second = torch.zeros(4)  # given the first draft was accepted
    for _ in range(num_trials):
        emitted = accept_sampled(P, drafts, generator)
        first[emitted[0]] += 1
        if emitted[0] == drafts[0]:
            second[emitted[1]] += 1
    assert _chi_square(first, P[0]) < CHI2_CRITICAL_DF3
    assert _chi_square(second, P[1]) < CHI2_CRITICAL_DF3
    # The acceptance rate of the first draft is its target probability.
    assert first[drafts[0]] / num_trials == pytest.approx(P[0, drafts[0]].item(), abs=0.015)


def test_a_draft_of_probability_zero_is_never_accepted():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(4)
    for _ in range(4000):
        emitted = accept_sampled(probs, [3], generator)
        assert len(emitted) == 1
        counts[emitted[0]] += 1
    assert counts[2:].sum() == 0 and abs(counts[0] - counts[1]) < 250
    # A draft of probability 1 is always accepted, then the bonus token is drawn.
    assert accept_sampled(probs[1:].repeat(2, 1), [2], generator) == [2, 2]


def test_verification_rows_see_the_drafts_before_them():
    """Row ``i`` is penalized as if drafts ``1 .. i`` were generated (repetition penalty)."""
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=1)
    request = Request("a", prompt_token_ids=[0], sampling_params=params)
    logits = torch.tensor([[0.0, 1.5, 1.0, 0.0]] * 3)
    emitted, record = verify_request(logits, request, [1, 1])
    assert emitted == [1, 2]  # row 1 divides token 1's logit by 2: 0.75 < 1.0
    raw = logits[0].log_softmax(dim=0)
    torch.testing.assert_close(record.logprobs, raw[[1, 2]])
    assert record.top_ids[:, 0].tolist() == [1, 1]


def test_speculative_config_merges_and_validates():
    base = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    assert base.merged({"num_speculative_tokens": 2}).num_speculative_tokens == 2
    assert not base.merged({"method": None}).enabled
    assert not base.merged({"num_speculative_tokens": 0}).enabled
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens"):
        base.merged({"num_speculative_tokens": -1})
    assert base.merged({"num_speculative_tokens": 32}).num_speculative_tokens == 32
    with pytest.raises(
        ValueError, match=r"speculative.num_speculative_tokens must be <= 32, got 33"
    ):
        base.merged({"num_speculative_tokens": 33})
    with pytest.raises(ValueError, match="speculative.depth: unknown field"):
        base.merged({"depth": 3})
    with pytest.raises(ValueError, match="speculative_method"):
        SpeculativeConfig(method="medusa").validate()


@pytest.mark.parametrize(
    ("base", "overrides", "message"),
    [
        (SpeculativeConfig(method="ngram"), {"draft_recent_tokens": 16},
         "speculative.draft_recent_tokens applies only to method 'sparse_self'; the request's "
         "method is 'ngram'"),
        (SpeculativeConfig(), {"method": "ngram", "draft_sink_tokens": 4},
         "speculative.draft_sink_tokens applies only to method 'sparse_self'; the request's "
         "method is 'ngram'"),
        (SpeculativeConfig(method="sparse_self"), {"method": None, "draft_recent_tokens": 16},
         "speculative.draft_recent_tokens applies only to method 'sparse_self'; the request's "
         "method is None"),
        (SpeculativeConfig(method="sparse_self"), {"ngram_prompt_lookup_max": 2},
         "speculative.ngram_prompt_lookup_max applies only to method 'ngram'; the request's "
         "method is 'sparse_self'"),
        (SpeculativeConfig(method="sparse_self"),
         {"num_speculative_tokens": 0, "draft_vocab_size": 64},
         "speculative.draft_vocab_size applies only with speculation on; the request's "
         "num_speculative_tokens is 0"),
    ],
)  # fmt: skip
def test_a_request_field_its_method_never_reads_is_rejected(base, overrides, message):
    merged = base.merged(overrides)
    with pytest.raises(ValueError) as caught:
        merged.check_request_fields(overrides)
    assert str(caught.value) == message


def test_request_fields_of_the_requests_own_method_are_accepted():
    # The engine's settings may hold the other method's fields: requests inherit them.
    base = SpeculativeConfig(method="ngram", draft_recent_tokens=16)
    for overrides in (
        {"ngram_prompt_lookup_max": 2},
        {"method": "sparse_self", "draft_recent_tokens": 32, "draft_sink_tokens": 0},
        {"method": None},
        {"num_speculative_tokens": 0},
    ):
        base.merged(overrides).check_request_fields(overrides)


class _Head:
    """A model whose logits are fixed: row ``i`` peaks at id ``40 + i``, then at ``i``."""

    def __init__(self, num_rows: int) -> None:
        self.widths: list[int | None] = []
        self.logits = torch.zeros(num_rows, 64)
        for i in range(num_rows):
            self.logits[i, 40 + i] = 2.0
            self.logits[i, i] = 1.0

    def compute_logits(self, hidden, num_tokens=None):
        self.widths.append(num_tokens)
        return self.logits[:, :num_tokens]


def test_self_drafts_stay_within_each_requests_vocabulary():
    head = _Head(3)
    hidden = torch.zeros(3, 8)
    assert self_draft._argmax_drafts(head, hidden, [16, None, 32]) == [0, 41, 2]
    assert self_draft._argmax_drafts(head, hidden, [16, 48, 32]) == [0, 41, 2]
    assert self_draft._argmax_drafts(head, hidden, [16, 16, 16]) == [0, 1, 2]
    assert head.widths == [None, 48, 16]  # one head product, as wide as the widest row


def test_draft_vocabulary_rounds_up_to_groups_of_16():
    assert self_draft.draft_vocab(0) is None
    assert [self_draft.draft_vocab(n) for n in (1, 16, 17, 8192)] == [16, 16, 32, 8192]
    with pytest.raises(ValueError, match="speculative.draft_vocab_size must be an integer >= 0"):
        SpeculativeConfig(method="sparse_self").merged({"draft_vocab_size": -1})
    with pytest.raises(ValueError, match="applies only to method 'sparse_self'"):
        overrides = {"method": "ngram", "draft_vocab_size": 64}
        SpeculativeConfig().merged(overrides).check_request_fields(overrides)


def test_the_engine_logs_its_speculation_settings(caplog):
    from sparsekv.engine.engine_setup import _log_speculation

    with caplog.at_level("INFO", logger="sparsekv.engine.engine_setup"):
        _log_speculation(SpeculativeConfig(method="sparse_self", draft_vocab_size=8192))
        _log_speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=0))
    assert caplog.messages == [
        "speculative decoding: sparse_self, 4 draft tokens per step, view 64 sink + 448 recent "
        "tokens, draft vocabulary 8192",
        "speculative decoding: off unless a request opts in",
    ]
