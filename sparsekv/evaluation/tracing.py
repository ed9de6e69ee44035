"""Multi-hop tracing: variable tracking (RULER, arXiv 2404.06654).

A chain ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE``, ... is hidden in the haystack, one
statement per sentence boundary, in chain order. The answer is every variable that ends up
holding the chain's value. Extra chains (``num_chains > 1``) are distractors with other values.
"""

from __future__ import annotations

import random
import string
from typing import Any

from sparsekv.evaluation.haystack import Needle, get_haystack
from sparsekv.evaluation.length import Draft
from sparsekv.evaluation.sample import Sample, make_sample

VT_PROMPT = (
    "Memorise and track the chain of variable assignments hidden in the text below.\n\n"
    "{context}\n\n"
    "Question: find all variables that are assigned the value {value} in the text above."
)
VT_ANSWER_PREFIX = (
    "Answer: according to the chain of variable assignments in the text above, the variables "
    "assigned the value {value} are:"
)


def _draw_names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct 5-letter upper-case variable names."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    return names


def _chain_statements(names: list[str], value: str) -> list[str]:
    """``VAR n0 = value.`` then ``VAR n{i} = VAR n{i-1}.`` for each hop."""
    first = f"VAR {names[0]} = {value}."
    return [first] + [f"VAR {cur} = VAR {prev}." for prev, cur in zip(names, names[1:])]


def variable_tracking(
    tokenizer: Any,
    length: int,
    *,
    seed: int = 0,
    num_hops: int = 4,
    num_chains: int = 1,
    haystack: str = "noise",
) -> Sample:
    """Variable tracking: follow ``num_hops`` assignments from a 5-digit value.

    Args:
        tokenizer: Hugging Face tokenizer; its chat template is counted in ``length``.
        length: target prompt + answer length, in tokens.
        seed: seeds names, values and statement depths.
        num_hops: assignments after the first (4 in RULER); the chain has ``num_hops + 1``
            variables.
        num_chains: chains hidden; the first is asked about, the rest are distractors.
        haystack: ``noise`` (RULER's choice) or ``essay``.

    Returns:
        A :class:`Sample` whose answers are the asked chain's variable names (metric ``all``).

    Raises:
        ValueError: ``num_hops < 1`` or ``num_chains < 1``.
    """
    if num_hops < 1 or num_chains < 1:
        raise ValueError(f"need num_hops >= 1 and num_chains >= 1, got {num_hops}, {num_chains}")
    rng = random.Random(seed)
    names = _draw_names(rng, num_chains * (num_hops + 1))
    values: list[str] = []
    while len(values) < num_chains:
        value = str(rng.randint(10_000, 99_999))
        if value not in values:
            values.append(value)
    chains = [names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)] for c in range(num_chains)]
    needles: list[Needle] = []
    for chain, value in zip(chains, values):
        depths = sorted(rng.random() for _ in chain)
        needles.extend(Needle(d, s) for d, s in zip(depths, _chain_statements(chain, value)))
    hay = get_haystack(haystack)
    metadata = {"haystack": hay.name, "value": values[0], "chains": chains}

    def build(num_words: int) -> Draft:
        prompt = VT_PROMPT.format(context=hay.text(num_words, needles), value=values[0])
        prefix = VT_ANSWER_PREFIX.format(value=values[0])
        return Draft(prompt, list(chains[0]), metadata, prefix)

    return make_sample("vt", build, tokenizer, length, seed=seed, metric="all")
