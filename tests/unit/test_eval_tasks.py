"""Long-context task generators against the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from sparsekv.evaluation.fidelity import long_texts
from sparsekv.evaluation.haystack import NOISE_SENTENCES
from sparsekv.evaluation.length import answer_prefix_ids, prompt_token_ids
from sparsekv.evaluation.retrieval import NEEDLE_SENTENCE, PASSKEY_SENTENCE
from sparsekv.evaluation.runner import build_cases, sample_prompt_ids
from sparsekv.evaluation.scoring import score
from sparsekv.evaluation.tasks import RETRIEVAL_TASKS, TASKS, generate

TOLERANCE = 8  # tokens; the search usually lands within 2


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def context_of(sample) -> str:
    """The haystack part of a prompt: between the instruction and the question."""
    parts = sample.prompt_text.split("\n\n")
    assert len(parts) == 3, "prompts are instruction, context, question"
    return parts[1]


@pytest.mark.parametrize("target", [500, 900, 2000])
@pytest.mark.parametrize("task", sorted(TASKS))
def test_length_hits_target_with_chat_template(tokenizer, task, target):
    sample = generate(task, tokenizer, target, seed=3)
    ids = prompt_token_ids(tokenizer, sample.messages)
    ids += answer_prefix_ids(tokenizer, sample.answer_prefix)
    answer = tokenizer.encode(", ".join(sample.answers), add_special_tokens=False)
    assert sample.answer_prefix, "every task ends its prompt with an answer prefix (RULER)"
    assert len(ids) == sample.metadata["num_prompt_tokens"]
    assert len(ids) + len(answer) == sample.length
    assert abs(sample.length - target) <= TOLERANCE
    assert (
        ids[:3]
        == tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True
        )["input_ids"][:3]
    ), "the template's header is counted"


@pytest.mark.parametrize("task", sorted(TASKS))
def test_perfect_reader_scores_100(tokenizer, task):
    sample = generate(task, tokenizer, 900, seed=5)
    assert sample.answers
    assert all(answer in sample.prompt_text for answer in sample.answers)
    assert score(sample.metric, ", ".join(sample.answers), sample.answers) == 100.0


def test_passkey_sentence_is_exact(tokenizer):
    sample = generate("passkey", tokenizer, 700, depth=0.4, seed=11)
    (key,) = sample.answers
    assert re.fullmatch(r"\d{5}", key)
    assert PASSKEY_SENTENCE.format(key=key) in sample.prompt_text
    assert sample.prompt_text.endswith("What is the pass key?")
    assert NOISE_SENTENCES[0] in context_of(sample)


@pytest.mark.parametrize(
    ("task", "num_needles", "num_answers"),
    [
        ("niah_single", 1, 1),
        ("niah_multikey", 4, 1),
        ("niah_multivalue", 4, 4),
        ("niah_multiquery", 4, 4),
    ],
)
def test_niah_needles_and_queries(tokenizer, task, num_needles, num_answers):
    sample = generate(task, tokenizer, 1200, depth=0.5, seed=2)
    found = re.findall(
        r"special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", sample.prompt_text
    )
    assert len(found) == num_needles
    assert len(sample.answers) == num_answers
    question = sample.prompt_text.split("\n\n")[-1]
    for key in sample.metadata["queries"]:
        assert key in question
        for value in sample.metadata["values"][key]:
            assert NEEDLE_SENTENCE.format(key=key, value=value) in sample.prompt_text
    distractors = set(sample.metadata["keys"]) - set(sample.metadata["queries"])
    assert not any(key in question for key in distractors)


def test_variable_tracking_chain_resolves_to_answers(tokenizer):
    sample = generate("vt", tokenizer, 1500, seed=8)
    value = sample.metadata["value"]
    holds: dict[str, str] = {}
    for name, source in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d{5})\.", sample.prompt_text):
        holds[name] = holds[source[4:]] if source.startswith("VAR ") else source
    assert len(holds) == 5, "4 hops: 5 variables"
    assert sorted(n for n, v in holds.items() if v == value) == sorted(sample.answers)
    assert value in sample.prompt_text.split("\n\n")[-1]


@pytest.mark.parametrize("target", [500, 2000])
def test_common_words_answers_are_most_frequent(tokenizer, target):
    sample = generate("cwe", tokenizer, target, seed=4)
    items = re.findall(r"^\d+\. (\w+)$", context_of(sample), flags=re.M)
    counts = Counter(items)
    assert len(sample.answers) == 10
    least_common_answer = min(counts[w] for w in sample.answers)
    most_common_other = max(c for w, c in counts.items() if w not in sample.answers)
    assert least_common_answer > most_common_other


def test_frequent_words_top3(tokenizer):
    sample = generate("fwe", tokenizer, 1500, seed=6)
    ranked = Counter(context_of(sample).split()).most_common()
    assert [w for w, _ in ranked[:3]] == sample.answers
    assert ranked[0][1] > ranked[1][1] > ranked[2][1] > ranked[3][1]


@pytest.mark.parametrize("task", ["passkey", "niah_single"])
def test_depth_places_needle(tokenizer, task):
    positions = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        sample = generate(task, tokenizer, 1500, depth=depth, seed=1)
        context = context_of(sample)
        marker = sample.answers[0]
        positions.append(context.index(marker) / len(context))
    assert positions[0] < 0.03, positions
    assert positions[-1] > 0.9, positions
    assert positions == sorted(positions)
    assert abs(positions[2] - 0.5) < 0.1


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_by_seed(tokenizer, task):
    first = generate(task, tokenizer, 600, seed=21)
    again = generate(task, tokenizer, 600, seed=21)
    other = generate(task, tokenizer, 600, seed=22)
    assert first == again
    assert other.answers != first.answers


def test_answers_do_not_depend_on_length(tokenizer):
    for task in sorted(TASKS):
        short = generate(task, tokenizer, 500, seed=9)
        long = generate(task, tokenizer, 1500, seed=9)
        assert short.answers == long.answers, task


def test_generate_rejects_bad_input(tokenizer):
    with pytest.raises(ValueError, match="unknown task"):
        generate("nope", tokenizer, 500)
    with pytest.raises(ValueError, match="no needle depth"):
        generate("cwe", tokenizer, 500, depth=0.5)
    with pytest.raises(ValueError, match="depth"):
        generate("passkey", tokenizer, 500, depth=1.5)
    with pytest.raises(ValueError, match="too short"):
        generate("niah_multiquery", tokenizer, 40)
    assert RETRIEVAL_TASKS <= set(TASKS)


def test_long_texts_are_real_and_cut(tokenizer):
    texts = long_texts(tokenizer, min_tokens=600, count=4)
    assert len(texts) == 4
    assert len({name for name, _ in texts}) == 4
    assert any(name.startswith("stdlib/") for name, _ in texts)
    for _, text in texts:
        assert abs(len(tokenizer.encode(text, add_special_tokens=False)) - 600) <= 2
    assert long_texts(tokenizer, min_tokens=600, count=4) == texts


@pytest.mark.parametrize("prompt_format", ["chat", "completion"])
def test_prompts_end_with_the_answer_prefix(tokenizer, prompt_format):
    """Both prompt formats end with the task's answer prefix; chat puts it after the assistant
    header, completion after the question as plain text."""
    sample = generate("passkey", tokenizer, 500, depth=0.5, seed=1)
    ids = sample_prompt_ids(tokenizer, sample, prompt_format)
    prefix = answer_prefix_ids(tokenizer, sample.answer_prefix)
    assert prefix and ids[-len(prefix) :] == prefix
    text = tokenizer.decode(ids)
    assert text.rstrip().endswith("I remember it. The pass key is")
    has_header = "<|im_start|>assistant" in text
    assert has_header == (prompt_format == "chat")
    with pytest.raises(ValueError, match="prompt_format"):
        build_cases(tokenizer, ["passkey"], [500], 1, prompt_format="raw")


def test_chat_plain_prompt_ends_with_the_assistant_header(tokenizer):
    """``chat-plain``: the question as a plain user message, nothing after the header."""
    sample = generate("passkey", tokenizer, 500, depth=0.5, seed=1)
    ids = sample_prompt_ids(tokenizer, sample, "chat-plain")
    assert ids == sample_prompt_ids(tokenizer, sample, "chat")[: len(ids)]
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert "The pass key is" not in text.split("<|im_start|>assistant")[-1]
