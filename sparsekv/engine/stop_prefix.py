"""How much of a growing text may still be the start of a stop string, in time linear in the
text: the Knuth-Morris-Pratt automaton of each stop string (Knuth, Morris and Pratt, 1977,
"Fast pattern matching in strings").

The detokenizer holds back the longest suffix of its text that is a proper prefix of a stop
string, so a stop string is never half-sent. Comparing every suffix length again after each
token costs O(L^2) per token and stop string (L: the text or stop length), milliseconds per
token for a few long stop strings; the automaton reads each new character once.
"""

from __future__ import annotations


def prefix_function(pattern: str) -> list[int]:
    """``fail[i]``: the length of the longest proper prefix of ``pattern[: i + 1]`` that is
    also its suffix (the KMP failure function). O(len(pattern))."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return fail


class StopPrefix:
    """The longest suffix of a text, fed a piece at a time, that is a proper prefix of
    ``stop`` (a non-empty string).

    ``feed(piece)`` returns that length for the text fed so far; a complete occurrence of
    ``stop`` is the caller's to find (the detokenizer searches for it first and stops).
    """

    def __init__(self, stop: str) -> None:
        if not stop:
            raise ValueError("stop: a stop string must not be empty")
        self._stop = stop
        self._fail = prefix_function(stop)
        self._state = 0  # length of the longest suffix that is a prefix (may be len(stop))

    def feed(self, piece: str) -> int:
        """Append ``piece`` to the text; returns the held-back length (< ``len(stop)``)."""
        stop, fail, full = self._stop, self._fail, len(self._stop)
        state = self._state
        for ch in piece:
            if state == full:
                state = fail[full - 1]
            while state and stop[state] != ch:
                state = fail[state - 1]
            if stop[state] == ch:
                state += 1
        self._state = state
        return state if state < full else fail[full - 1]
