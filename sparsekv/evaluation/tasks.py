"""Long-context task generators (RULER, arXiv 2404.06654), by name.

Every generator takes ``(tokenizer, length, ...)``, is deterministic given ``seed``, and
returns a :class:`Sample` whose templated prompt plus expected answer is within a few tokens of
``length``. Retrieval tasks also take a ``depth`` in ``[0, 1]``.

==================  =======================================================================
name                what
==================  =======================================================================
``passkey``         5-digit pass key in the noise haystack
``niah_single``     one needle ("special magic number" for an adjective-noun key), essay
``niah_multikey``   one asked key among 4 keys
``niah_multivalue`` 4 values hidden for the asked key
``niah_multiquery`` 4 keys asked at once
``vt``              variable tracking, 4 hops, noise haystack
``cwe``             the 10 common words of a numbered list
``fwe``             the 3 most frequent coded words of a Zipf (alpha 2) text
==================  =======================================================================
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from sparsekv.evaluation.aggregation import common_words, frequent_words
from sparsekv.evaluation.retrieval import niah, passkey
from sparsekv.evaluation.sample import Sample
from sparsekv.evaluation.tracing import variable_tracking

__all__ = [
    "TASKS",
    "RETRIEVAL_TASKS",
    "Sample",
    "common_words",
    "frequent_words",
    "generate",
    "niah",
    "passkey",
    "variable_tracking",
]

TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey,
    "niah_single": functools.partial(niah, task="niah_single"),
    "niah_multikey": functools.partial(niah, num_keys=4, task="niah_multikey"),
    "niah_multivalue": functools.partial(niah, num_values=4, task="niah_multivalue"),
    "niah_multiquery": functools.partial(niah, num_keys=4, num_queries=4, task="niah_multiquery"),
    "vt": variable_tracking,
    "cwe": common_words,
    "fwe": frequent_words,
}

RETRIEVAL_TASKS = frozenset(
    {"passkey", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"}
)


def generate(
    task: str,
    tokenizer: Any,
    length: int,
    *,
    depth: float | None = None,
    seed: int = 0,
    **options: Any,
) -> Sample:
    """One sample of ``task`` at ``length`` tokens.

    Args:
        task: a key of :data:`TASKS`.
        tokenizer: Hugging Face tokenizer; its chat template is counted in ``length``.
        length: target prompt + answer length, in tokens.
        depth: needle depth in ``[0, 1]`` for retrieval tasks (default 0.5); must be ``None``
            for the others.
        seed: makes the sample reproducible.
        **options: task-specific keyword arguments (``haystack``, ``num_hops``...).

    Raises:
        ValueError: an unknown task, or a depth given to a task without needles.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
    if task in RETRIEVAL_TASKS:
        options["depth"] = 0.5 if depth is None else depth
    elif depth is not None:
        raise ValueError(f"task {task!r} has no needle depth")
    return TASKS[task](tokenizer, length, seed=seed, **options)
