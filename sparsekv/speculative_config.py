"""Speculative decoding settings (``SpeculativeConfig``), for the engine or one request.

Validation raises ``ValueError`` naming the field; the CLI flags are generated from the fields
(``sparsekv.cli_args``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "sparse_self")
# Draft tokens per step at most: a verification is K + 1 query rows per request and layer.
MAX_SPECULATIVE_TOKENS = 32
# The fields only one drafter reads, and that drafter's method.
SPECULATIVE_METHOD_FIELDS = {
    "ngram_prompt_lookup_min": "ngram",
    "ngram_prompt_lookup_max": "ngram",
    "draft_sink_tokens": "sparse_self",
    "draft_recent_tokens": "sparse_self",
    "draft_vocab_size": "sparse_self",
}


@dataclass
class SpeculativeConfig:
    """Speculative decoding: cheap draft tokens verified by one step of the target model.

    A request with drafts scores its last token and ``k`` drafts as one short chunk against its
    own KV cache, keeps the longest accepted prefix plus one token of the target's, and rolls the
    rest back (docs/speculative.md). Greedy output is unchanged; sampled output keeps the
    target's distribution (rejection sampling).

    The ``ngram_*`` fields are read only by the ``ngram`` drafter and the ``draft_*`` fields only
    by ``sparse_self``. In the engine's settings the other method's fields are kept unchecked:
    they are the defaults a request inherits when it switches method (and a dataclass cannot
    tell a default from a value that was set). A request that itself gives a field its own
    method never reads gets a ``ValueError`` naming it (``check_request_fields``) instead of
    having it ignored.

    Attributes:
        method: how drafts are proposed: ``ngram`` (prompt lookup: the tokens that followed the
            latest earlier occurrence of the sequence's last n tokens) or ``sparse_self`` (the
            model itself drafts, reading only the sink and most recent pages of its own
            cache); unset is off.
        num_speculative_tokens: draft tokens proposed per request and step (K), at most
            32 (``MAX_SPECULATIVE_TOKENS``).
        ngram_prompt_lookup_min: shortest suffix n-gram the ``ngram`` drafter matches.
        ngram_prompt_lookup_max: longest suffix n-gram the ``ngram`` drafter matches (tried
            first).
        draft_sink_tokens: ``sparse_self``: leading slots of each layer the draft reads
            (rounded up to whole pages).
        draft_recent_tokens: ``sparse_self``: most recent slots of each layer the draft
            reads (extended back to a page start); sliding-window layers read their window.
        draft_vocab_size: ``sparse_self``: the draft proposes only token ids below this
            (rounded up to a multiple of 16) and reads only those rows of the output head;
            0, or at least the vocabulary, proposes from all of it.
            Verification always scores the whole vocabulary.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    ngram_prompt_lookup_min: int = 1
    ngram_prompt_lookup_max: int = 4
    draft_sink_tokens: int = 64
    draft_recent_tokens: int = 448
    draft_vocab_size: int = 0

    @property
    def enabled(self) -> bool:
        return self.method is not None and self.num_speculative_tokens > 0

    def validate(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        names = ("num_speculative_tokens", "ngram_prompt_lookup_min")
        for name in (*names, "draft_sink_tokens", "draft_recent_tokens", "draft_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.ngram_prompt_lookup_min < 1:
            raise ValueError(
                f"ngram_prompt_lookup_min must be >= 1, got {self.ngram_prompt_lookup_min}"
            )
        high = self.ngram_prompt_lookup_max
        if (
            not isinstance(high, int)
            or isinstance(high, bool)
            or high < self.ngram_prompt_lookup_min
        ):
            raise ValueError(
                f"ngram_prompt_lookup_max must be an integer >= ngram_prompt_lookup_min "
                f"({self.ngram_prompt_lookup_min}), got {high!r}"
            )

    def check_request_fields(self, given: Iterable[str]) -> None:
        """Reject fields a request gave that its method (these merged settings') never reads.

        Args:
            given: the names of the fields the request set.

        Raises:
            ValueError: naming ``speculative.<field>``, e.g. ``draft_recent_tokens`` with the
                ``ngram`` method or with speculation off.
        """
        for name in given:
            owner = SPECULATIVE_METHOD_FIELDS.get(name)
            if owner is not None and self.method != owner:
                raise ValueError(
                    f"speculative.{name} applies only to method {owner!r}; the request's "
                    f"method is {self.method!r}"
                )
            if owner is not None and not self.enabled:  # the method, but no drafts
                raise ValueError(
                    f"speculative.{name} applies only with speculation on; the request's "
                    f"num_speculative_tokens is 0"
                )

    def merged(self, overrides: dict) -> SpeculativeConfig:
        """A copy with a request's ``speculative`` fields applied (``method: null`` or
        ``num_speculative_tokens: 0`` opts the request out).

        Raises:
            ValueError: an unknown field or an invalid merged setting.
        """
        names = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in names:
                raise ValueError(
                    f"speculative.{key}: unknown field; fields: {', '.join(sorted(names))}"
                )
        merged = dataclasses.replace(self, **overrides)
        try:
            merged.validate()
        except ValueError as exc:
            message = str(exc).removeprefix("speculative_")
            raise ValueError(f"speculative.{message}") from None
        return merged
