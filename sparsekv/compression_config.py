"""The KV compression policy's settings (``CompressionConfig``), for the engine or one request.

Validation raises ``ValueError`` naming ``kv_compression.<field>`` and its allowed values; the
CLI flags are generated from the fields (``sparsekv.cli_args``).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

COMPRESSION_METHODS = (
    "none",
    "snapkv",
    "pyramidkv",
    "h2o",
    "streaming_llm",
    "tova",
    "knorm",
    "random",
    "expected_attention",
    "kvzip",
)
HEAD_BUDGETS = ("flat", "adaptive")
LAYER_SCORES = ("own", "first")
# Fields checked for their type before their values (a float budget would reach the page
# allocator; a string ratio would fail a comparison with a TypeError).
_INT_FIELDS = ("budget", "window", "kernel_size", "full_layers", "context_tokens")
# Widest pooling kernel: pooling costs tokens x kernel_size per scored row, so an unbounded
# width from one request (2^31 - 1) would hold the engine step for many minutes; SnapKV and
# kvpress use 5 to 31.
MAX_KERNEL_SIZE = 1023
_REAL_FIELDS = ("compression_ratio",)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class CompressionConfig:
    """A KV compression policy, for the engine (its default) or one request.

    Budgets: a budgeted layer keeps ``budget`` slots, the observation window included; with
    ``compression_ratio`` r instead, each budgeted layer keeps
    ``max(window + 1, ceil((1 - r) * n_prompt))`` slots. The first ``full_layers`` layers and
    sliding-window layers are never compressed. ``pyramidkv`` reads the budget as the average
    over budgeted layers. ``docs/compression.md`` describes every method.

    Attributes:
        method: compression method; ``none`` keeps the full cache.
        budget: KV slots each budgeted layer keeps, observation window included; prompts
            this short or shorter are not compressed.
        compression_ratio: fraction of the prompt's tokens removed in each budgeted layer, in
            [0, 1), instead of a budget. ``0`` turns the policy off for the request.
        window: observation window: the last N prompt tokens, whose queries score the rest.
        pooling: smoothing of the scores over neighbouring tokens (``none`` = off).
        kernel_size: pooling kernel width (odd, at most ``MAX_KERNEL_SIZE``; stride 1, same
            padding).
        gqa_agg: how the scores of a KV group's query heads are combined.
        full_layers: the first N layers keep a full cache.
        layer_budgets: explicit budget per layer (0 = full cache), e.g. ``0,0,512,...``;
            overrides budget, ratio and full_layers.
        layer_fractions: fraction of the compressed tokens each layer keeps, in (0, 1] (1 =
            full cache), e.g. from ``sparsekv calibrate``; overrides budget, ratio and
            full_layers.
        decode_eviction: during decode, re-score a layer and compact it back to its budget
            when it holds ``budget + block_size`` slots.
        chunked_mode: when a chunked prefill is scored: ``exact`` (once, after the last
            chunk) or ``bounded`` (after every chunk: less memory, approximate).
        scope: what is compressed: the whole ``prompt``, or only the ``context`` before the
            last user message (compressed once, then shared by later requests).
        context_tokens: for scope ``context`` on a completion prompt, the context length
            (another scope rejects it).
        head_budgets: how a layer's budget is split among its KV heads: ``flat`` (every head
            keeps ``budget`` slots) or ``adaptive`` (the heads share ``num_kv_heads * budget``
            slots by score, Ada-KV; set once at prefill, no decode-time eviction).
        layer_scores: whose scores rank a budgeted layer's slots when a prompt is compressed:
            its ``own``, or those of the ``first`` budgeted layer that compresses in the same
            forward (as GemFilter selects tokens with an early layer's attention; a layer
            holding another number of slots scores its own; docs/compression.md).
    """

    method: str = "snapkv"
    budget: int | None = 1024
    compression_ratio: float | None = None
    window: int = 32
    pooling: str = "max"
    kernel_size: int = 15
    gqa_agg: str = "mean"
    full_layers: int = 2
    layer_budgets: tuple[int, ...] | None = None
    layer_fractions: tuple[float, ...] | None = None
    decode_eviction: bool = True
    chunked_mode: str = "exact"
    scope: str = "prompt"
    context_tokens: int | None = None
    head_budgets: str = "flat"
    layer_scores: str = "own"

    @property
    def enabled(self) -> bool:
        """False when the policy removes nothing (method none or ratio 0)."""
        return self.method != "none" and self.compression_ratio != 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the parameter when the policy is invalid."""
        self._check_types()
        if self.method not in COMPRESSION_METHODS:
            raise ValueError(
                f"kv_compression.method: unknown method {self.method!r}; "
                f"choose one of {', '.join(COMPRESSION_METHODS)}"
            )
        if self.budget is not None and self.compression_ratio is not None:
            raise ValueError(
                "kv_compression.budget and kv_compression.compression_ratio are exclusive"
            )
        if self.window < 1:
            raise ValueError(f"kv_compression.window must be >= 1, got {self.window}")
        # A budget, or a layer's, holds the observation window too; method none keeps no budget.
        budgeted = self.method != "none"
        if budgeted and self.budget is not None and self.budget < self.window + 1:
            raise ValueError(
                f"kv_compression.budget ({self.budget}) must be >= window + 1 ({self.window + 1})"
            )
        if self.compression_ratio is not None and not 0 <= self.compression_ratio < 1:
            raise ValueError(
                f"kv_compression.compression_ratio must be in [0, 1), got {self.compression_ratio}"
            )
        if self.pooling not in ("max", "avg", "none"):
            raise ValueError(
                f"kv_compression.pooling must be max, avg or none, got {self.pooling!r}"
            )
        if not 1 <= self.kernel_size <= MAX_KERNEL_SIZE or self.kernel_size % 2 == 0:
            raise ValueError(
                f"kv_compression.kernel_size must be an odd number in [1, {MAX_KERNEL_SIZE}], "
                f"got {self.kernel_size}"
            )
        if self.gqa_agg not in ("mean", "max"):
            raise ValueError(f"kv_compression.gqa_agg must be mean or max, got {self.gqa_agg!r}")
        if self.full_layers < 0:
            raise ValueError(f"kv_compression.full_layers must be >= 0, got {self.full_layers}")
        if self.layer_budgets is not None:
            for b in self.layer_budgets:
                if budgeted and b != 0 and b < self.window + 1:
                    raise ValueError(
                        f"kv_compression.layer_budgets: {b} is below window + 1 ({self.window + 1})"
                    )
        if self.layer_fractions is not None:
            if self.layer_budgets is not None:
                raise ValueError(
                    "kv_compression.layer_fractions and kv_compression.layer_budgets are exclusive"
                )
            for f in self.layer_fractions:
                if not 0 < f <= 1:
                    raise ValueError(f"kv_compression.layer_fractions: {f} is not in (0, 1]")
        if self.chunked_mode not in ("exact", "bounded"):
            raise ValueError(
                f"kv_compression.chunked_mode must be exact or bounded, got {self.chunked_mode!r}"
            )
        if self.scope not in ("prompt", "context"):
            raise ValueError(f"kv_compression.scope must be prompt or context, got {self.scope!r}")
        if self.context_tokens is not None and self.context_tokens < 1:
            raise ValueError(
                f"kv_compression.context_tokens must be >= 1, got {self.context_tokens}"
            )
        if self.context_tokens is not None and self.scope != "context":
            # Only scope "context" reads it: under another scope it would be silently ignored.
            raise ValueError(
                f"kv_compression.context_tokens applies only to scope 'context'; the scope is "
                f"{self.scope!r}"
            )
        if self.head_budgets not in HEAD_BUDGETS:
            raise ValueError(
                f"kv_compression.head_budgets must be flat or adaptive, got {self.head_budgets!r}"
            )
        if self.layer_scores not in LAYER_SCORES:
            raise ValueError(
                f"kv_compression.layer_scores must be own or first, got {self.layer_scores!r}"
            )
        if self.head_budgets == "adaptive" and self.chunked_mode == "bounded":
            raise ValueError(
                "kv_compression.head_budgets: adaptive budgets are set once at the end of the "
                "prompt; chunked_mode bounded compresses every chunk"
            )

    def _check_types(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"kv_compression.{name} must be an integer, got {value!r}")
        for name in _REAL_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_real(value):
                raise ValueError(f"kv_compression.{name} must be a number, got {value!r}")
        if not isinstance(self.decode_eviction, bool):
            raise ValueError(
                f"kv_compression.decode_eviction must be true or false, got {self.decode_eviction!r}"
            )
        for name in ("layer_budgets", "layer_fractions"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list | tuple):
                raise ValueError(f"kv_compression.{name} must be a list, got {value!r}")
        if self.layer_budgets is not None and not all(map(_is_int, self.layer_budgets)):
            raise ValueError(
                f"kv_compression.layer_budgets must be integers, got {self.layer_budgets!r}"
            )
        if self.layer_fractions is not None and not all(map(_is_real, self.layer_fractions)):
            raise ValueError(
                f"kv_compression.layer_fractions must be numbers, got {self.layer_fractions!r}"
            )

    def merged(self, overrides: dict) -> CompressionConfig:
        """Return a copy with ``overrides`` applied field by field.

        Budget and ratio are one choice: giving either replaces the other; so are per-layer
        budgets and fractions.

        Raises:
            ValueError: an unknown field name, or the merged policy is invalid.
        """
        names = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in names:
                raise ValueError(
                    f"kv_compression.{key}: unknown field; fields: {', '.join(sorted(names))}"
                )
        values = dict(overrides)
        if "budget" in values and "compression_ratio" not in values:
            values["compression_ratio"] = None
        if "compression_ratio" in values and "budget" not in values:
            values["budget"] = None
        # Per-layer budgets and fractions are one choice too.
        if "layer_budgets" in values and "layer_fractions" not in values:
            values["layer_fractions"] = None
        if "layer_fractions" in values and "layer_budgets" not in values:
            values["layer_budgets"] = None
        for name in ("layer_budgets", "layer_fractions"):
            if isinstance(values.get(name), list):  # JSON arrays; anything else: validate()
                values[name] = tuple(values[name])
        merged = dataclasses.replace(self, **values)
        merged.validate()
        return merged
