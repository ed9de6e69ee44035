"""CLI flags generated from the config dataclasses (CONTRACTS.md §3), so names never drift."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from sparsekv.config import (
    COMPRESSION_METHODS,
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from sparsekv.kv_cache.quant import KV_CACHE_DTYPES

SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "compression": CompressionConfig,
}

# Flag names that are not the field name in kebab case.
FLAG_NAMES = {
    ("compression", "method"): "kv-compression",
    ("compression", "budget"): "kv-budget",
    ("compression", "compression_ratio"): "kv-compression-ratio",
}
CHOICES = {
    ("compression", "method"): COMPRESSION_METHODS,
    ("compression", "pooling"): ("max", "avg", "none"),
    ("compression", "gqa_agg"): ("mean", "max"),
    ("compression", "chunked_mode"): ("exact", "bounded"),
    ("compression", "scope"): ("prompt", "context"),
    ("scheduler", "preemption_mode"): ("swap", "recompute"),
    ("model", "dtype"): ("auto", "bfloat16", "float32"),
    ("cache", "kv_cache_dtype"): KV_CACHE_DTYPES,
}
SKIPPED = {("model", "seed"), ("compression", "context_tokens")}


def flag_name(section: str, field_name: str) -> str:
    if (section, field_name) in FLAG_NAMES:
        return FLAG_NAMES[(section, field_name)]
    prefix = "kv-" if section == "compression" else ""
    return prefix + field_name.replace("_", "-")


def _base_type(annotation) -> type:
    hints = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or hints:
        non_none = [h for h in hints if h is not type(None)]
        return _base_type(non_none[0]) if non_none else str
    return annotation


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError("expected on or off")
    return text == "on"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError("expected a comma-separated list of integers") from exc


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field; defaults are the dataclass defaults."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if (section, f.name) in SKIPPED:
                continue
            dest = f"{section}__{f.name}"
            flag = "--" + flag_name(section, f.name)
            default = f.default
            if (section, f.name) == ("compression", "budget"):
                default = None  # resolved below: 1024 unless a ratio is given
            kind = _base_type(hints[f.name])
            doc = f"(default: {default})"
            if f.name == "decode_eviction":
                group.add_argument(flag, dest=dest, type=_on_off, default=default, help="on|off")
            elif kind is bool:
                group.add_argument(
                    flag, dest=dest, action=argparse.BooleanOptionalAction, default=default
                )
            elif f.name in ("layer_budgets", "kv_cache_full_precision_layers"):
                group.add_argument(flag, dest=dest, type=_int_list, default=None, help=doc)
            else:
                choices = CHOICES.get((section, f.name))
                group.add_argument(
                    flag, dest=dest, type=kind, default=default, choices=choices, help=doc
                )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build and validate an ``EngineConfig`` from parsed flags.

    Raises:
        ValueError: an invalid combination (e.g. both --kv-budget and --kv-compression-ratio).
    """
    values: dict[str, dict] = {section: {} for section in SECTIONS}
    for key, value in vars(args).items():
        if "__" in key:
            section, name = key.split("__", 1)
            if section in values:
                values[section][name] = value
    compression = values["compression"]
    if compression.get("budget") is None and compression.get("compression_ratio") is None:
        compression["budget"] = CompressionConfig.budget
    config = EngineConfig(**{s: SECTIONS[s](**v) for s, v in values.items()})
    config.validate()
    return config
