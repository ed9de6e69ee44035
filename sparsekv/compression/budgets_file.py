"""Per-layer budgets files: what ``sparsekv calibrate`` writes and ``--kv-layer-budgets-file``
reads (docs/compression.md, "Calibrated layer budgets").

A JSON object::

    {"format": "sparsekv-layer-budgets", "version": 1, "kind": "fractions",
     "num_layers": 30, "budgets": [1.0, 1.0, 0.21, ...], "model": "...", ...}

``kind`` ``fractions``: the fraction of the compressed tokens each layer keeps, in ``(0, 1]``
(``1`` = a full layer); ``tokens``: a budget in slots per layer, ``0`` = full (the values of
``--kv-layer-budgets``). Any other keys (the model, the ratio, the measurement) are kept for
the record and ignored when the file is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "sparsekv-layer-budgets"
VERSION = 1
KINDS = ("fractions", "tokens")


@dataclass(frozen=True)
class LayerBudgets:
    """A validated budgets file.

    Attributes:
        kind: ``fractions`` or ``tokens``.
        budgets: one value per layer (floats in ``(0, 1]``, or ints ``>= 0``).
        extra: the file's other keys (model, ratio, measurement), written back as they are.
    """

    kind: str
    budgets: tuple[float, ...] | tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.budgets)

    def validate(self, num_layers: int | None = None) -> None:
        """Raise ``ValueError`` naming the field when the budgets are invalid.

        Args:
            num_layers: the model's layers, when known (the length must match).
        """
        name = "kv_layer_budgets_file"
        if self.kind not in KINDS:
            raise ValueError(f"{name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.budgets:
            raise ValueError(f"{name}: budgets is empty")
        if num_layers is not None and len(self.budgets) != num_layers:
            raise ValueError(
                f"{name}: {len(self.budgets)} budgets for a model with {num_layers} layers"
            )
        for layer, value in enumerate(self.budgets):
            if self.kind == "fractions":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                if not ok or not math.isfinite(value) or not 0 < value <= 1:
                    raise ValueError(
                        f"{name}: budgets[{layer}] = {value!r}; a fraction must be in (0, 1]"
                    )
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"{name}: budgets[{layer}] = {value!r}; a token budget is an integer >= 0"
                )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "num_layers": self.num_layers,
            "budgets": list(self.budgets),
            **self.extra,
        }


def save_budgets(path: str | Path, budgets: LayerBudgets) -> None:
    """Validate and write ``budgets`` as JSON.

    Raises:
        ValueError: invalid budgets.
    """
    budgets.validate()
    Path(path).write_text(json.dumps(budgets.to_json(), indent=2) + "\n", encoding="utf-8")


def load_budgets(path: str | Path, num_layers: int | None = None) -> LayerBudgets:
    """Read and validate a budgets file.

    Args:
        path: the JSON file.
        num_layers: the model's layers, when known.

    Raises:
        ValueError: unreadable file, not a budgets file, or invalid budgets (naming the field).
    """
    name = "kv_layer_budgets_file"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: cannot read {str(path)!r}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{name}: {str(path)!r} is not a {FORMAT} file")
    version = data.get("version")
    # An int, not a bool or a float: JSON's true and 1.0 compare equal to 1.
    if not _is_int(version) or version != VERSION:
        raise ValueError(f"{name}: version {version!r} is not {VERSION} (an integer)")
    values = data.get("budgets")
    if not isinstance(values, list):
        raise ValueError(f"{name}: budgets must be a list")
    if not _is_int(data.get("num_layers")) or data.get("num_layers") != len(values):
        raise ValueError(
            f"{name}: num_layers is {data.get('num_layers')!r} but {len(values)} budgets are given"
        )
    reserved = {"format", "version", "kind", "num_layers", "budgets"}
    extra = {k: v for k, v in data.items() if k not in reserved}
    budgets = LayerBudgets(str(data.get("kind")), tuple(values), extra)
    budgets.validate(num_layers)
    return budgets


def _is_int(value) -> bool:
    """A JSON integer: ``int`` but not ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
