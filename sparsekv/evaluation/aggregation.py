"""Aggregation tasks: common-words and frequent-words extraction (RULER, arXiv 2404.06654).

Both grow one list item at a time, so :func:`~sparsekv.evaluation.length.fit_length` can hit a
token target closely. Word identities come from the seed alone (a prefix of one random stream),
so the answer words do not change with the length; the shuffle depends on seed and size.
"""

from __future__ import annotations

import math
import random
import string
from typing import Any

from sparsekv.evaluation.length import Draft
from sparsekv.evaluation.sample import Sample, make_sample
from sparsekv.evaluation.words import WORDS

CWE_PROMPT = (
    "Below is a numbered list of words. Some words appear much more often than the others. "
    "Memorise the ones that appear most often.\n\n"
    "{context}\n\n"
    "Question: what are the {num_common} most common words in the list above?"
)
FWE_PROMPT = (
    "Read the coded text below and keep count of how often each coded word appears.\n\n"
    "{context}\n\n"
    "Question: what are the 3 most frequent coded words in the text above?"
)
CWE_ANSWER_PREFIX = "Answer: the {num_common} most common words in the list above are:"
FWE_ANSWER_PREFIX = "Answer: the 3 most frequent coded words in the text above are:"


def common_word_counts(
    num_items: int, num_common: int, pool_size: int, freq_common: int, freq_uncommon: int
) -> tuple[int, int]:
    """``(common_freq, uncommon_freq)`` for a list of about ``num_items`` items.

    Common words take about half the list, capped at ``freq_common`` repeats (RULER uses 30);
    uncommon words repeat ``freq_uncommon`` times (3), more only when the word pool runs out.
    Common words always occur strictly more often than any uncommon word.
    """
    common = min(freq_common, max(freq_uncommon + 1, num_items // (2 * num_common)))
    num_uncommon_items = max(0, num_items - common * num_common)
    uncommon = max(freq_uncommon, math.ceil(num_uncommon_items / pool_size))
    return max(common, uncommon + 1), uncommon


def common_words(
    tokenizer: Any,
    length: int,
    *,
    seed: int = 0,
    num_common: int = 10,
    freq_common: int = 30,
    freq_uncommon: int = 3,
) -> Sample:
    """Common-words extraction: name the ``num_common`` words repeated most in a numbered list.

    Args:
        tokenizer: Hugging Face tokenizer; its chat template is counted in ``length``.
        length: target prompt + answer length, in tokens.
        seed: seeds the words and their order.
        num_common: words to find (10 in RULER).
        freq_common: repeats of each common word, at most (fewer in short lists).
        freq_uncommon: repeats of each other word (the last one may repeat less).

    Returns:
        A :class:`Sample` whose answers are the common words (metric ``all``).
    """
    if num_common < 1 or freq_uncommon < 1 or num_common >= len(WORDS):
        raise ValueError(f"need 1 <= num_common < {len(WORDS)} and freq_uncommon >= 1")
    vocab = random.Random(seed).sample(WORDS, len(WORDS))
    common, pool = vocab[:num_common], vocab[num_common:]

    def build(num_items: int) -> Draft:
        f_common, f_uncommon = common_word_counts(
            num_items, num_common, len(pool), freq_common, freq_uncommon
        )
        num_uncommon_items = max(0, num_items - f_common * num_common)
        items = [w for w in common for _ in range(f_common)]
        items += [pool[i // f_uncommon] for i in range(num_uncommon_items)]
        random.Random(f"{seed}:{num_items}").shuffle(items)
        context = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        prompt = CWE_PROMPT.format(context=context, num_common=num_common)
        counts = {"freq_common": f_common, "freq_uncommon": f_uncommon}
        return Draft(prompt, list(common), counts, CWE_ANSWER_PREFIX.format(num_common=num_common))

    min_items = num_common * (freq_uncommon + 1)
    return make_sample(
        "cwe", build, tokenizer, length, seed=seed, metric="all", min_units=min_items
    )


def zipf_counts(num_words: int, alpha: float = 2.0) -> list[int]:
    """Occurrences by frequency rank for ``num_words`` words drawn with Zipf exponent ``alpha``.

    Rank ``r`` gets ``round(N * r**-alpha / H)`` (at least 1); ranks are added while the
    expected count is >= 1, rank 1 absorbs the rounding, and the top 4 are made strictly
    decreasing so the 3 most frequent words are unambiguous.
    """
    ranks = 4
    while num_words * (ranks + 1) ** -alpha / _harmonic(ranks + 1, alpha) >= 1.0:
        ranks += 1
    norm = _harmonic(ranks, alpha)
    counts = [max(1, round(num_words * r**-alpha / norm)) for r in range(1, ranks + 1)]
    counts[0] += num_words - sum(counts)
    for r in range(2, -1, -1):
        counts[r] = max(counts[r], counts[r + 1] + 1)
    return counts


def _harmonic(n: int, alpha: float) -> float:
    return sum(r**-alpha for r in range(1, n + 1))


def _coded_words(seed: int, count: int) -> list[str]:
    """``count`` distinct 5-letter lower-case coded words; a prefix of one seeded stream."""
    rng = random.Random(f"fwe:{seed}")
    words: list[str] = []
    while len(words) < count:
        word = "".join(rng.choices(string.ascii_lowercase, k=5))
        if word not in words:
            words.append(word)
    return words


def frequent_words(tokenizer: Any, length: int, *, seed: int = 0, alpha: float = 2.0) -> Sample:
    """Frequent-words extraction: the 3 most frequent coded words of a Zipf-distributed text.

    Args:
        tokenizer: Hugging Face tokenizer; its chat template is counted in ``length``.
        length: target prompt + answer length, in tokens.
        seed: seeds the coded words and their order.
        alpha: Zipf exponent (2 in RULER).

    Returns:
        A :class:`Sample` whose answers are the top-3 words, most frequent first (metric
        ``all``).
    """
    if alpha <= 1.0:
        raise ValueError(f"alpha must be > 1, got {alpha}")

    def build(num_words: int) -> Draft:
        counts = zipf_counts(num_words, alpha)
        vocab = _coded_words(seed, len(counts))
        items = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(f"{seed}:{num_words}").shuffle(items)
        prompt = FWE_PROMPT.format(context=" ".join(items))
        return Draft(prompt, vocab[:3], {"counts": counts}, FWE_ANSWER_PREFIX)

    return make_sample("fwe", build, tokenizer, length, seed=seed, metric="all", min_units=16)
