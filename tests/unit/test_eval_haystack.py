"""Haystacks, length fitting and count rules, without a real tokenizer."""

from __future__ import annotations

import pytest

from sparsekv.evaluation import haystack as haystack_module
from sparsekv.evaluation.aggregation import common_word_counts, zipf_counts
from sparsekv.evaluation.corpus import essay_paragraphs
from sparsekv.evaluation.haystack import (
    NOISE_SENTENCES,
    Haystack,
    Needle,
    essay_haystack,
    get_haystack,
    noise_haystack,
)
from sparsekv.evaluation.length import Draft, _token_ids, fit_length, prompt_token_ids


class WordTokenizer:
    """One token per whitespace-separated word; no chat template."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [0] * (len(text.split()) + (1 if add_special_tokens else 0))


def test_noise_haystack_repeats_reference_sentences():
    text = noise_haystack().text(40)
    assert text.startswith(" ".join(NOISE_SENTENCES))
    assert len(text.split()) == 40


def test_words_and_boundaries():
    hay = Haystack("t", ("a b.", "c d e."))
    words, boundaries = hay.words(6)
    assert words == ["a", "b.", "c", "d", "e.", "a"]
    assert boundaries == [0, 2, 5]


def test_needles_snap_to_sentence_boundaries():
    hay = Haystack("t", ("a b.", "c d e."))
    assert hay.text(5, [Needle(0.0, "N.")]) == "N. a b. c d e."
    assert hay.text(5, [Needle(1.0, "N.")]) == "a b. c d e. N."
    assert hay.text(5, [Needle(0.5, "N.")]) == "a b. N. c d e."
    # Two needles at one boundary keep their given order.
    assert hay.text(5, [Needle(0.4, "X."), Needle(0.4, "Y.")]) == "a b. X. Y. c d e."
    # Depth 1 on a haystack cut mid-sentence: after the last complete sentence.
    assert hay.text(6, [Needle(1.0, "N.")]) == "a b. c d e. N. a"
    with pytest.raises(ValueError, match="depth"):
        hay.text(5, [Needle(1.5, "N.")])


def test_essay_haystack_is_prose_and_falls_back(monkeypatch):
    if essay_paragraphs():
        hay = essay_haystack()
        assert hay.name == "essay"
        assert len(hay.sentences) > 100
        assert not set(hay.sentences) & set(NOISE_SENTENCES)
    monkeypatch.setattr(haystack_module, "essay_paragraphs", lambda: [])
    assert essay_haystack.__wrapped__() == noise_haystack()
    with pytest.raises(ValueError, match="unknown haystack"):
        get_haystack("hay")


@pytest.mark.parametrize("target", [7, 50, 333, 1000])
def test_fit_length_is_exact_with_unit_steps(target):
    tok = WordTokenizer()
    fit = fit_length(lambda n: Draft("w " * n, ["ans"]), tok, target)
    assert fit.num_tokens == target  # 1 special + n words + 1 answer word
    assert fit.num_units == target - 2
    with pytest.raises(ValueError, match="too short"):
        fit_length(lambda n: Draft("w " * n, ["ans"]), tok, 10, min_units=20)


def test_token_ids_accepts_every_return_shape():
    class Encoding(dict):
        def __getattr__(self, name):
            return self[name]

    assert _token_ids([1, 2, 3]) == [1, 2, 3]
    assert _token_ids({"input_ids": [1, 2]}) == [1, 2]
    assert _token_ids(Encoding(input_ids=[[4, 5]])) == [4, 5]
    assert prompt_token_ids(WordTokenizer(), [{"role": "user", "content": "a b c"}]) == [0] * 4


def test_zipf_counts_have_distinct_top4():
    for num_words in (16, 40, 137, 1000, 5000):
        counts = zipf_counts(num_words)
        assert counts[0] > counts[1] > counts[2] > counts[3]
        assert counts == sorted(counts, reverse=True)
        assert sum(counts) >= num_words
    counts = zipf_counts(1000)
    assert sum(counts) == 1000
    assert counts[1] == round(1000 / 4 / sum(r**-2 for r in range(1, len(counts) + 1)))


def test_common_word_counts_keep_common_words_ahead():
    assert common_word_counts(1000, 10, 500, 30, 3) == (30, 3)
    assert common_word_counts(100, 10, 500, 30, 3) == (5, 3)
    # The word pool runs out: uncommon words repeat more, common words stay ahead.
    common, uncommon = common_word_counts(10_000, 10, 100, 30, 3)
    assert uncommon == 97 and common == 98
