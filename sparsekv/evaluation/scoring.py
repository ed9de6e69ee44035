"""Scoring of generated answers against reference strings, in percent (0-100).

RULER (arXiv 2404.06654): ``all`` = fraction of references found in the output
(case-insensitive substring), ``part`` = 100 if any is found; the passkey is correct when its
digits appear in the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _check_references(references: Sequence[str]) -> None:
    if isinstance(references, str) or not references:
        raise ValueError("references must be a non-empty list of strings")


def score_all(prediction: str, references: Sequence[str]) -> float:
    """Percent of ``references`` found in ``prediction`` (case-insensitive).

    Raises:
        ValueError: ``references`` is empty or a bare string.
    """
    _check_references(references)
    text = prediction.lower()
    found = sum(ref.lower() in text for ref in references)
    return 100.0 * found / len(references)


def score_part(prediction: str, references: Sequence[str]) -> float:
    """100 if any of ``references`` is found in ``prediction`` (case-insensitive), else 0.

    Raises:
        ValueError: ``references`` is empty or a bare string.
    """
    _check_references(references)
    text = prediction.lower()
    return 100.0 if any(ref.lower() in text for ref in references) else 0.0


def score_passkey(prediction: str, references: Sequence[str]) -> float:
    """100 if the pass key's digits appear in ``prediction``, else 0.

    Digits may be separated by spaces or commas in the answer ("12 345" counts); other
    digits around them do not matter, as in RULER's substring match.

    Raises:
        ValueError: ``references`` is empty or a bare string.
    """
    _check_references(references)
    squeezed = "".join(ch for ch in prediction if ch not in " ,")
    return 100.0 if any(ref in prediction or ref in squeezed for ref in references) else 0.0


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "all": score_all,
    "part": score_part,
    "passkey": score_passkey,
}


def score(metric: str, prediction: str, references: Sequence[str]) -> float:
    """Score one prediction with the metric called ``metric`` (0-100).

    Raises:
        ValueError: an unknown metric or empty references.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {sorted(METRICS)}")
    return METRICS[metric](prediction, references)


def mean_score(
    metric: str, predictions: Sequence[str], references: Sequence[Sequence[str]]
) -> float:
    """Mean score (0-100) over paired predictions and reference lists.

    Raises:
        ValueError: the two lists differ in length or are empty.
    """
    if len(predictions) != len(references) or not predictions:
        raise ValueError(
            f"need as many predictions as reference lists (>0), got {len(predictions)} "
            f"and {len(references)}"
        )
    scores = [score(metric, p, r) for p, r in zip(predictions, references)]
    return sum(scores) / len(scores)
