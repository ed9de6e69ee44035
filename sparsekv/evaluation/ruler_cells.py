"""Cells of the RULER grid from method specs: a method, optionally with its own settings.

A spec is ``method`` or ``method:key=value[:key=value...]``; the settings override the base
policy (the engine's ``--kv-*`` flags) for that method's cells only, so variants of one method
share a run (and its prefills):

* ``kernel_size=7``, ``window=64``, ``pooling=avg``...: any ``CompressionConfig`` field;
* ``budgets=FILE``: a budgets file (``sparsekv calibrate``); ``{ratio}`` in ``FILE`` is replaced
  by the cell's ratio (``cal_{ratio}.json`` -> ``cal_0.75.json``), as a calibration is made
  for one ratio. The file's budgets replace the ratio; the cell keeps the ratio as its label.

The spec is the cell's method label in every report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sparsekv.config import CompressionConfig
from sparsekv.evaluation.runner import Cell, build_cells


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``(method, {setting: text})`` of a spec.

    Raises:
        ValueError: a setting without ``=``.
    """
    method, *settings = spec.split(":")
    parsed = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"methods: {spec!r}: settings are key=value, got {item!r}")
        parsed[key] = value
    return method, parsed


_BOOLEANS = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def _apply(policy: CompressionConfig, settings: dict[str, str], ratio: float,
           spec: str) -> CompressionConfig:  # fmt: skip
    fields = {f.name: f for f in dataclasses.fields(CompressionConfig)}
    changes: dict = {}
    for key, text in settings.items():
        if key == "budgets":
            from sparsekv.compression.budgets_file import load_budgets

            budgets = load_budgets(text.replace("{ratio}", f"{ratio:g}"))
            name = "layer_fractions" if budgets.kind == "fractions" else "layer_budgets"
            changes[name] = tuple(budgets.budgets)
            continue
        if key not in fields or key in ("method", "compression_ratio", "budget"):
            raise ValueError(f"methods: {spec!r}: {key!r} is not a setting a cell may change")
        default = getattr(CompressionConfig(), key)
        if isinstance(default, bool):  # bool("off") is True
            if text.lower() not in _BOOLEANS:
                raise ValueError(f"methods: {spec!r}: {key} is on or off, got {text!r}")
            changes[key] = _BOOLEANS[text.lower()]
        else:
            changes[key] = type(default)(text) if default is not None else text
    policy = dataclasses.replace(policy, **changes)
    policy.validate()
    return policy


def grid_cells(specs: Sequence[str], ratios: Sequence[float],
               base: CompressionConfig) -> list[Cell]:  # fmt: skip
    """``none`` once, every other spec at every ratio (``runner.build_cells`` plus settings).

    Raises:
        ValueError: an unknown method or setting, a ratio outside [0, 1), a bad budgets file.
    """
    cells = []
    for spec in specs:
        method, settings = parse_spec(spec)
        for cell in build_cells([method], ratios, base):
            if settings:
                policy = _apply(cell.policy, settings, cell.ratio, spec)
                cell = Cell(spec, cell.ratio, policy)
            cells.append(cell)
    return cells
