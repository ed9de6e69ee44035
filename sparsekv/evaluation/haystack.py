"""Haystacks: filler text, cut to a word count, with needle sentences placed at given depths.

RULER (arXiv 2404.06654) uses two haystacks reproduced here:

* ``noise``: the sentence group "The grass is green. The sky is blue. The sun is yellow. Here we
  go. There and back again." repeated;
* ``essay``: real prose. RULER uses essays it downloads; here the prose is the Python language
  reference shipped in ``pydoc_data`` plus the license texts on the machine
  (:mod:`sparsekv.evaluation.corpus`). Where none is found it falls back to ``noise``.

A haystack is a cycle of sentences repeated as often as needed and cut to a number of words, so a
length search (:func:`sparsekv.evaluation.length.fit_length`) can grow it one word at a time.
Needles go at sentence boundaries only.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sparsekv.evaluation.corpus import essay_paragraphs

NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"“(])")


@dataclass(frozen=True)
class Needle:
    """A sentence to hide in a haystack.

    Attributes:
        depth: where it goes, as a fraction of the haystack's words in ``[0, 1]`` (0 = before
            the first sentence, 1 = after the last complete one); snapped to the nearest
            sentence boundary.
        text: the sentence itself.
    """

    depth: float
    text: str


@dataclass(frozen=True)
class Haystack:
    """A cycle of filler sentences, repeated and cut to length.

    Attributes:
        name: ``noise`` or ``essay`` (``noise`` when the essay fell back for lack of prose).
        sentences: one cycle of the filler; repeated as often as a length needs.
    """

    name: str
    sentences: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.sentences:
            raise ValueError("a haystack needs at least one sentence")

    def words(self, num_words: int) -> tuple[list[str], list[int]]:
        """The first ``num_words`` words of the repeated cycle and its sentence boundaries.

        Returns:
            ``(words, boundaries)``: ``boundaries`` are word indices in ``[0, num_words]`` where
            a sentence starts or the text ends after a complete sentence; always contains 0.
        """
        if num_words < 0:
            raise ValueError(f"num_words must be >= 0, got {num_words}")
        words: list[str] = []
        boundaries = [0]
        index = 0
        while len(words) < num_words:
            words.extend(self.sentences[index % len(self.sentences)].split())
            index += 1
            if len(words) <= num_words:
                boundaries.append(len(words))
        return words[:num_words], boundaries

    def text(self, num_words: int, needles: Sequence[Needle] = ()) -> str:
        """``num_words`` words of filler with each needle inserted at its depth.

        Needles at the same boundary keep their given order. The needle words are not counted
        in ``num_words``.

        Raises:
            ValueError: a depth outside ``[0, 1]``.
        """
        words, boundaries = self.words(num_words)
        inserts: dict[int, list[str]] = {}
        for needle in needles:
            if not 0.0 <= needle.depth <= 1.0:
                raise ValueError(f"needle depth must be in [0, 1], got {needle.depth}")
            goal = needle.depth * num_words
            # Nearest boundary; ties go to the earlier one so depth 0.5 is stable.
            at = min(boundaries, key=lambda b: (abs(b - goal), b))
            inserts.setdefault(at, []).append(needle.text)
        pieces: list[str] = []
        for i in range(len(words) + 1):
            pieces.extend(inserts.get(i, ()))
            if i < len(words):
                pieces.append(words[i])
        return " ".join(pieces)


def noise_haystack() -> Haystack:
    """RULER's noise haystack: its five filler sentences, repeated."""
    return Haystack("noise", NOISE_SENTENCES)


@functools.lru_cache(maxsize=1)
def essay_haystack() -> Haystack:
    """Real prose split into sentences; the noise haystack when no prose is on the machine."""
    sentences: list[str] = []
    for paragraph in essay_paragraphs():
        sentences.extend(s for s in _SENTENCE_END.split(paragraph) if s.strip())
    if not sentences:
        return noise_haystack()
    return Haystack("essay", tuple(sentences))


HAYSTACKS = {"noise": noise_haystack, "essay": essay_haystack}


def get_haystack(name: str) -> Haystack:
    """The haystack called ``name`` (``noise`` or ``essay``).

    Raises:
        ValueError: an unknown name.
    """
    if name not in HAYSTACKS:
        raise ValueError(f"unknown haystack {name!r}; choose one of {sorted(HAYSTACKS)}")
    return HAYSTACKS[name]()
