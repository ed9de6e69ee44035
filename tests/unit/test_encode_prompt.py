"""``engine.prompts.encode_prompt`` on token-id prompts: integers pass through unchanged,
booleans (an ``int`` subclass in Python) are refused rather than read as ids 1 and 0."""

from __future__ import annotations

import pytest

from sparsekv.engine.prompts import encode_prompt


def test_token_ids_pass_through():
    assert encode_prompt(None, [5, 0, 49151]) == [5, 0, 49151]


@pytest.mark.parametrize("prompt", [[True, 5], [5, False]])
def test_booleans_are_not_token_ids(prompt):
    with pytest.raises(ValueError, match="^prompt: token ids must be integers, got a boolean$"):
        encode_prompt(None, prompt)


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="^prompt: the prompt is empty$"):
        encode_prompt(None, [])
