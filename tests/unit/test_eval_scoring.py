"""Scoring rules (RULER string match, in percent)."""

from __future__ import annotations

import pytest

from sparsekv.evaluation.scoring import (
    METRICS,
    mean_score,
    score,
    score_all,
    score_part,
    score_passkey,
)

REFERENCES = ["4821937", "1029384", "5550123", "7777001"]


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_references_score_100_and_empty_scores_0(metric):
    refs = ["12345"] if metric == "passkey" else REFERENCES
    assert score(metric, " ".join(refs), refs) == 100.0
    assert score(metric, "", refs) == 0.0


def test_all_gives_exact_partial_credit():
    assert score_all("4821937 and 5550123", REFERENCES) == 50.0
    assert score_all("only 7777001", REFERENCES) == 25.0
    assert score_all("4821937, 1029384, 5550123", REFERENCES) == 75.0


def test_part_needs_one_reference():
    assert score_part("maybe 1029384?", REFERENCES) == 100.0
    assert score_part("no idea", REFERENCES) == 0.0


def test_matching_ignores_case():
    refs = ["Lively-Tower", "BLUE"]
    assert score_all("the answer: lively-tower and blue", refs) == 100.0
    assert score_part("LIVELY-TOWER", refs) == 100.0


def test_passkey_digits_must_appear():
    assert score_passkey("The pass key is 27611.", ["27611"]) == 100.0
    assert score_passkey("It is 27 611", ["27611"]) == 100.0
    assert score_passkey("The pass key is 27610.", ["27611"]) == 0.0
    assert score_passkey("2761", ["27611"]) == 0.0


def test_mean_score_and_errors():
    predictions = ["4821937 1029384 5550123 7777001", "4821937", ""]
    assert mean_score("all", predictions, [REFERENCES] * 3) == pytest.approx((100 + 25 + 0) / 3)
    with pytest.raises(ValueError, match="unknown metric"):
        score("exact", "x", ["x"])
    with pytest.raises(ValueError, match="non-empty"):
        score_all("x", [])
    with pytest.raises(ValueError, match="non-empty"):
        score_all("x", "x")
    with pytest.raises(ValueError, match="as many"):
        mean_score("all", ["a"], [])
