"""Sampler: greedy, truncation, penalties, min_tokens, seeding and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from sparsekv.sampling import Sampler, SamplingBatch
from sparsekv.sampling.processors import apply_penalties
from sparsekv.sampling_params import SamplingParams

VOCAB = 64


def sample(logits, params, generators=None, prompt_ids=None, output_ids=None, eos=()):
    rows = len(params)
    batch = SamplingBatch.from_requests(
        params,
        generators or [None] * rows,
        prompt_ids or [[] for _ in range(rows)],
        output_ids or [[] for _ in range(rows)],
        eos_token_ids=eos,
    )
    return Sampler()(logits, batch)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=seeded(seed)) * 3


def test_greedy_is_argmax_on_the_fast_path():
    logits = random_logits(5)
    params = [SamplingParams(temperature=0.0)] * 5
    batch = SamplingBatch.from_requests(params, [None] * 5, [[]] * 5, [[]] * 5)
    assert batch.is_argmax_only
    assert torch.equal(Sampler()(logits, batch).token_ids, logits.argmax(dim=-1))


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.zeros(2, VOCAB)
    logits[:, [7, 3, 40]] = 5.0
    greedy = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0)]
    assert sample(logits, greedy).token_ids.tolist() == [3, 3]
    # A batch of plain greedy rows takes the argmax-only path: the same tie rule.
    plain = [SamplingParams(temperature=0.0)] * 2
    assert sample(logits, plain).token_ids.tolist() == [3, 3]


def test_argmax_matches_tensor_max_on_ties_and_non_finite_logits():
    # The CPU fp32 argmax goes through NumPy; torch.max's first-index rule is the reference.
    gen = seeded(11)
    for rows, vocab in [(16, 49152), (3, 5), (7, 1000)]:
        logits = torch.randint(-2, 3, (rows, vocab), generator=gen).float()
        special = torch.rand(rows, vocab, generator=gen)
        logits[special < 0.02] = -0.0
        logits[(special > 0.5) & (special < 0.51)] = math.inf
        logits[(special > 0.7) & (special < 0.705)] = -math.inf
        logits[0] = -math.inf
        logits[1, special[1] < 0.01] = math.nan
        for case in (logits, logits.t().contiguous().t(), logits.bfloat16()):
            greedy = sample(case, [SamplingParams(temperature=0.0)] * rows).token_ids
            assert torch.equal(greedy, case.max(dim=-1).indices)


def test_small_temperature_converges_to_greedy():
    logits = random_logits(8, seed=1)
    params = [SamplingParams(temperature=1e-3, seed=i) for i in range(8)]
    out = sample(logits, params, [seeded(i) for i in range(8)])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize(
    ("params", "tie"),
    [
        (SamplingParams(top_k=1), True),
        (SamplingParams(top_p=1e-6), True),
        (SamplingParams(min_p=1.0), False),  # min_p keeps every token tied at the top
    ],
)
def test_degenerate_truncation_equals_greedy(params, tie):
    logits = random_logits(16, seed=2)
    if tie:  # the rank comes from a stable sort: the lower id wins, as in argmax
        logits[0, [5, 9]] = logits[0].max() + 1.0
    torch.manual_seed(0)
    for _ in range(5):
        out = sample(logits, [params] * 16)
        assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def probs_logits(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(rows, -1).contiguous()


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.8), {0, 1}),
        (SamplingParams(top_p=0.81), {0, 1, 2}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # threshold 0.1 drops 0.05
        (SamplingParams(min_p=0.7), {0}),  # threshold 0.35 drops 0.3
        (SamplingParams(), {0, 1, 2, 3}),
    ],
)
def test_truncation_support(params, support):
    logits = probs_logits([0.5, 0.3, 0.15, 0.05], 4000)
    torch.manual_seed(0)
    assert set(sample(logits, [params] * 4000).token_ids.tolist()) == support


def test_repetition_penalty_exact():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    batch = SamplingBatch.from_requests(params, [None], [[0, 1]], [[1, 3, 3]])
    expected = torch.tensor([[1.0, -2.0, 0.5, 1.5, -2.0]])  # seen: 0, 1, 3
    assert torch.equal(apply_penalties(logits, batch), expected)
    # Greedy rows take the argmax of the penalized logits: token 3 still leads (1.5 > 1.0).
    assert Sampler()(logits, batch).token_ids.tolist() == [3]


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    out = sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.5)], output_ids=[[0]])
    assert out.token_ids.tolist() == [1]  # 2.0 / 1.5 = 1.33 < 1.5


def test_presence_and_frequency_penalties_exact():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0.0),
    ]
    # Prompt tokens do not count for OpenAI penalties.
    batch = SamplingBatch.from_requests(params, [None, None], [[0, 2], [0]], [[1, 3, 3], [3]])
    expected = torch.tensor([[2.0, -1.0 - 0.75, 0.5, 3.0 - 1.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    assert torch.equal(apply_penalties(logits, batch), expected)


def test_all_penalties_compose_in_vllm_order():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(
            temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
        )
    ]
    batch = SamplingBatch.from_requests(params, [None], [[0]], [[1, 3, 3]])
    # repetition: [1.0, -2.0, 0.5, 1.5, -2.0]; then counts [0, 1, 0, 2, 0].
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.5, -2.0]])
    assert torch.equal(apply_penalties(logits, batch), expected)
    assert Sampler()(logits, batch).token_ids.tolist() == [0]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 10.0  # EOS
    logits[:, 9] = 9.0  # a stop token id
    logits[:, 20] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
    ]
    out = sample(logits, params, output_ids=[[5], [5], [5, 6]], eos=[2])
    assert out.token_ids.tolist() == [20, 2, 2]


def test_eos_ids_may_be_given_per_row():
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 10.0
    logits[:, 3] = 9.0
    params = [SamplingParams(temperature=0.0, min_tokens=1)] * 2
    out = sample(logits, params, eos=[[2], [3]])
    assert out.token_ids.tolist() == [3, 2]


def test_batch_moves_to_the_logits_device_and_bf16_is_upcast():
    logits = random_logits(3, seed=6)
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(seed=3), SamplingParams()]
    batch = SamplingBatch.from_requests(params, [None, seeded(3), None], [[]] * 3, [[]] * 3)
    moved = batch.to("meta")
    assert moved.random_rows.device.type == "meta" and moved.generators == batch.generators
    out = Sampler()(logits.bfloat16(), batch)
    assert out.token_ids[0] == logits.bfloat16().argmax(dim=-1)[0]
    assert out.logprobs.dtype == torch.float32


def test_seeded_sampling_repeats_and_differs_by_seed():
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is informative

    def run(seed: int) -> list[int]:
        g = seeded(seed)
        return [
            sample(logits, [SamplingParams(seed=seed)], [g]).token_ids.item() for _ in range(20)
        ]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_seeded_row_is_independent_of_the_batch():
    logits = random_logits(4, seed=3) / 3  # flat enough for varied samples
    target = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    alone_gen = seeded(11)
    alone = [sample(logits[2:3], [target], [alone_gen]).token_ids.item() for _ in range(30)]
    others = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(top_k=5, min_p=0.1),
        target,
        SamplingParams(temperature=1.5, seed=5, frequency_penalty=0.5),
    ]
    gens = [None, None, seeded(11), seeded(5)]
    torch.manual_seed(123)
    batched = [
        sample(logits, others, gens, output_ids=[[1, 2], [], [], [3]]).token_ids[2].item()
        for _ in range(30)
    ]
    assert batched == alone
    assert len(set(alone)) > 3


def test_sample_frequencies_match_probabilities():
    probs = [0.1, 0.2, 0.3, 0.4]
    rows = 20000
    torch.manual_seed(0)
    counts = torch.bincount(sample(probs_logits(probs, rows), [SamplingParams()] * rows).token_ids)
    for got, want in zip((counts / rows).tolist(), probs):
        assert abs(got - want) < 0.015  # ~4.5 standard deviations at 20000 draws

    g = seeded(0)
    one = probs_logits(probs, 1)
    draws = [sample(one, [SamplingParams(seed=0)], [g]).token_ids.item() for _ in range(2000)]
    freqs = torch.bincount(torch.tensor(draws), minlength=4) / len(draws)
    for got, want in zip(freqs.tolist(), probs):
        assert abs(got - want) < 0.05


def test_temperature_sharpens_distribution():
    logits = probs_logits([0.4, 0.6], 10000)
    torch.manual_seed(0)
    hot = sample(logits, [SamplingParams(temperature=0.5)] * 10000).token_ids.float().mean()
    # p(1) at T = 0.5: 0.36 / (0.16 + 0.36) = 0.692
    assert abs(hot.item() - 0.6923) < 0.02


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(3, seed=4)
    logits[1, [10, 4]] = 20.0  # tie at the top: ordered by id
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, logprobs=2, seed=1),
        SamplingParams(temperature=2.0, logprobs=0, top_k=3),
    ]
    out = sample(logits, params, [None, seeded(1), None], output_ids=[[0, 1], [], []])
    expected = logits.log_softmax(dim=-1)
    assert torch.equal(out.logprobs, expected.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (3, 5)
    assert torch.equal(out.top_logprobs, expected.gather(1, out.top_ids))
    assert out.top_ids[1, :2].tolist() == [4, 10]
    for row in range(3):
        sorted_ids = sorted(range(VOCAB), key=lambda t: (-expected[row, t].item(), t))
        assert out.top_ids[row].tolist() == sorted_ids[:5]
    assert math.isclose(out.top_logprobs[1, 0].item(), math.log(0.5), abs_tol=1e-4)


def test_top_logprob_ties_at_the_boundary_take_lower_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, 50] = 1.0
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=3)])
    assert out.top_ids.tolist() == [[50, 0, 1]]


def test_no_logprobs_unless_asked_and_logits_untouched():
    logits = random_logits(2, seed=5)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.2, top_k=4), SamplingParams(temperature=0.0)]
    out = sample(logits, params, output_ids=[[1, 2, 3], [4]])
    assert out.logprobs is None and out.top_ids is None
    assert torch.equal(logits, before)
