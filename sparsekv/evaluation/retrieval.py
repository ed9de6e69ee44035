"""Retrieval tasks: passkey and needle-in-a-haystack (RULER, arXiv 2404.06654).

The needle sentences follow RULER's word for word; the surrounding instructions are our
own wording. NIAH variants are one generator with RULER's three counts: keys hidden
(``num_keys``; extra keys are distractors), values per key (``num_values``) and keys asked
(``num_queries``).
"""

from __future__ import annotations

import random
from typing import Any

from sparsekv.evaluation.haystack import Needle, get_haystack
from sparsekv.evaluation.length import Draft
from sparsekv.evaluation.sample import Sample, check_depth, make_sample
from sparsekv.evaluation.words import ADJECTIVES, NOUNS

PASSKEY_SENTENCE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_PROMPT = (
    "A pass key is hidden somewhere in the long text below, among a lot of irrelevant text. "
    "Find the pass key and memorise it: I will ask you for it at the end.\n\n"
    "{context}\n\n"
    "What is the pass key?"
)

NEEDLE_SENTENCE = "One of the special magic numbers for {key} is: {value}."
NIAH_PROMPT = (
    "Special magic numbers are hidden in the long text below, each one tied to a key. "
    "Memorise all of them: afterwards I will ask you about some of them.\n\n"
    "{context}\n\n"
    "What are all the special magic numbers for {query} mentioned in the text above?"
)
PASSKEY_ANSWER_PREFIX = "I remember it. The pass key is"
NIAH_ANSWER_PREFIX = "The special magic numbers for {query} mentioned in the text above are:"


def passkey(
    tokenizer: Any, length: int, depth: float = 0.5, *, seed: int = 0, haystack: str = "noise"
) -> Sample:
    """Passkey retrieval: a 5-digit key hidden at ``depth`` in the noise haystack.

    Args:
        tokenizer: Hugging Face tokenizer; its chat template is counted in ``length``.
        length: target prompt + answer length, in tokens.
        depth: needle position as a fraction of the haystack, in ``[0, 1]``.
        seed: seeds the key; the same seed gives the same sample.
        haystack: ``noise`` (RULER's choice) or ``essay``.

    Returns:
        A :class:`Sample` with ``answers == [key]`` and metric ``passkey``.
    """
    depth = check_depth(depth)
    rng = random.Random(seed)
    key = str(rng.randint(10_000, 99_999))
    hay = get_haystack(haystack)
    needle = Needle(depth, PASSKEY_SENTENCE.format(key=key))

    def build(num_words: int) -> Draft:
        context = hay.text(num_words, [needle])
        prompt = PASSKEY_PROMPT.format(context=context)
        return Draft(prompt, [key], {"haystack": hay.name}, PASSKEY_ANSWER_PREFIX)

    return make_sample(
        "passkey", build, tokenizer, length, seed=seed, metric="passkey", depth=depth
    )


def _draw_keys(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct ``adjective-noun`` keys."""
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _draw_values(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct 7-digit numbers, as strings."""
    values: list[str] = []
    while len(values) < count:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in values:
            values.append(value)
    return values


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


def niah(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    *,
    seed: int = 0,
    num_keys: int = 1,
    num_values: int = 1,
    num_queries: int = 1,
    haystack: str = "essay",
    task: str = "niah_single",
) -> Sample:
    """Needle in a haystack: "One of the special magic numbers for {key} is: {value}.".

    The first needle (first key, first value) goes at ``depth``; the others at depths drawn
    from the seed. Keys are adjective-noun pairs, values 7-digit numbers; the first
    ``num_queries`` keys are asked for and all their values are the answers.

    Args:
        tokenizer: Hugging Face tokenizer; its chat template is counted in ``length``.
        length: target prompt + answer length, in tokens.
        depth: first needle's position as a fraction of the haystack, in ``[0, 1]``.
        seed: seeds keys, values and the other needles' depths.
        num_keys: keys hidden (1 = single; more = distractor keys for multi-key).
        num_values: values hidden per key (multi-value when > 1).
        num_queries: keys asked for (multi-query when > 1); at most ``num_keys``.
        haystack: ``essay`` or ``noise``.
        task: the name recorded in the sample.

    Raises:
        ValueError: a count below 1, ``num_queries > num_keys``, or a bad depth.
    """
    depth = check_depth(depth)
    if min(num_keys, num_values, num_queries) < 1 or num_queries > num_keys:
        raise ValueError(
            f"need 1 <= num_queries <= num_keys and num_values >= 1, got keys={num_keys} "
            f"values={num_values} queries={num_queries}"
        )
    rng = random.Random(seed)
    keys = _draw_keys(rng, num_keys)
    values = _draw_values(rng, num_keys * num_values)
    by_key = {k: values[i * num_values : (i + 1) * num_values] for i, k in enumerate(keys)}
    needle_depths = [depth] + [rng.random() for _ in range(len(values) - 1)]
    needles = [
        Needle(needle_depths[i * num_values + j], NEEDLE_SENTENCE.format(key=k, value=v))
        for i, k in enumerate(keys)
        for j, v in enumerate(by_key[k])
    ]
    queries = keys[:num_queries]
    answers = [v for k in queries for v in by_key[k]]
    hay = get_haystack(haystack)
    metadata = {
        "haystack": hay.name,
        "keys": keys,
        "queries": queries,
        "values": by_key,
        "needle_depths": needle_depths,
    }

    def build(num_words: int) -> Draft:
        context = hay.text(num_words, needles)
        prompt = NIAH_PROMPT.format(context=context, query=_join_keys(queries))
        return Draft(
            prompt, answers, metadata, NIAH_ANSWER_PREFIX.format(query=_join_keys(queries))
        )

    return make_sample(task, build, tokenizer, length, seed=seed, metric="all", depth=depth)
