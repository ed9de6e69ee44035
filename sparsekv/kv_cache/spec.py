"""Per-layer cache specs: what the model dictates about each layer's KV memory.

A model declares one ``LayerSpec`` per layer: ``full`` layers may become ``budgeted`` by a
request's compression policy; ``sliding`` layers keep only a model-defined window (Gemma 3 local
layers) and are never compressed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSpec:
    """Cache behaviour of one attention layer.

    Attributes:
        kind: ``full`` or ``sliding``.
        sliding_window: window in tokens for ``sliding`` layers (a query sees itself and the
            ``sliding_window - 1`` tokens before it).
    """

    kind: str = "full"
    sliding_window: int | None = None

    @property
    def is_sliding(self) -> bool:
        return self.kind == "sliding"

    @property
    def compressible(self) -> bool:
        return self.kind == "full"


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)
