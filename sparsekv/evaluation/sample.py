"""The value object every long-context task returns, and the fitting step they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparsekv.evaluation.length import Draft, fit_length


@dataclass(frozen=True)
class Sample:
    """One long-context test case (RULER, arXiv 2404.06654).

    Attributes:
        task: task name (a key of :data:`sparsekv.evaluation.tasks.TASKS`).
        messages: the prompt as a one-turn chat, ``[{"role": "user", "content": ...}]``.
        answers: reference strings; scored with :attr:`metric`.
        length: measured tokens of the templated prompt plus the expected answer.
        depth: needle depth in ``[0, 1]`` for retrieval tasks, else ``None``.
        metric: scoring rule name in :data:`sparsekv.evaluation.scoring.METRICS`.
        metadata: ``target_length``, ``num_prompt_tokens``, ``num_answer_tokens``, ``seed``,
            ``num_units`` (builder size), ``haystack`` and task-specific details.
        answer_prefix: the start of the answer the prompt ends with (RULER), e.g.
            ``"The pass key is"``; counted in ``length``.
    """

    task: str
    messages: list[dict[str, str]]
    answers: list[str]
    length: int
    depth: float | None
    metric: str
    metadata: dict[str, Any] = field(default_factory=dict)
    answer_prefix: str = ""

    @property
    def prompt_text(self) -> str:
        """The user message, for engines or models without a chat template."""
        return self.messages[-1]["content"]


def make_sample(
    task: str,
    build: Callable[[int], Draft],
    tokenizer: Any,
    length: int,
    *,
    seed: int,
    metric: str,
    depth: float | None = None,
    min_units: int = 0,
) -> Sample:
    """Fit ``build`` to ``length`` tokens and wrap the result as a :class:`Sample`.

    Raises:
        ValueError: ``length`` is not positive or too short for the task.
    """
    if length <= 0:
        raise ValueError(f"length must be a positive number of tokens, got {length}")
    fit = fit_length(build, tokenizer, length, min_units=min_units)
    metadata = {
        "target_length": length,
        "num_prompt_tokens": fit.num_prompt_tokens,
        "num_answer_tokens": fit.num_answer_tokens,
        "num_units": fit.num_units,
        "seed": seed,
        **fit.draft.metadata,
    }
    return Sample(
        task=task,
        messages=fit.draft.messages,
        answers=list(fit.draft.answers),
        length=fit.num_tokens,
        depth=depth,
        metric=metric,
        metadata=metadata,
        answer_prefix=fit.draft.answer_prefix,
    )


def check_depth(depth: float) -> float:
    """``depth`` as a float, after checking it lies in ``[0, 1]``.

    Raises:
        ValueError: a depth outside ``[0, 1]``.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    return float(depth)
