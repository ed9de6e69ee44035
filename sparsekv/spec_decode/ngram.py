"""The n-gram (prompt lookup) drafter: propose the tokens that followed an earlier occurrence of
the sequence's last n tokens.

The semantics of vLLM's n-gram proposer and of prompt lookup decoding (Saxena, 2023): try the
longest suffix first (``max_n`` down to ``min_n``), take its latest earlier occurrence in
prompt + output, and propose up to ``k`` tokens that followed it (fewer when the occurrence sits
near the end). Nothing is proposed when no suffix of those lengths occurred before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Draft tokens for a sequence by prompt lookup.

    Args:
        token_ids: the request's prompt + output ids so far.
        k: the most draft tokens to propose (>= 0).
        min_n: the shortest suffix length to match (>= 1).
        max_n: the longest suffix length to match (>= ``min_n``), tried first.

    Returns:
        Up to ``k`` token ids (empty when no suffix of ``min_n .. max_n`` tokens occurred
        earlier in the sequence, or ``k`` is 0).
    """
    num_tokens = len(token_ids)
    if k <= 0 or num_tokens < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = tokens[num_tokens - n :]
        # Candidate starts 0 .. num_tokens - n - 1: every window but the suffix itself.
        windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [num_tokens - n, n]
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if len(matches):
            start = int(matches[-1]) + n
            return tokens[start : start + k].tolist()
    return []
