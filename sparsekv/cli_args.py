"""CLI flags generated from the config dataclasses, so flag names, defaults and help never drift.

Each field of ``ModelConfig``, ``CacheConfig``, ``CompressionConfig``, ``SchedulerConfig``,
``ParallelConfig`` and ``SpeculativeConfig`` becomes one flag in a help section named after its
dataclass; the help line is the first sentence of the field's entry under ``Attributes:`` in the dataclass docstring,
followed by the field's default. Parsed values land in ``args.<section>__<field>`` and
:func:`engine_config_from_args` turns them back into an ``EngineConfig``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing

from sparsekv.config import (
    ATTENTION_BACKENDS,
    COMPRESSION_METHODS,
    HEAD_BUDGETS,
    LAYER_SCORES,
    PREFILL_QK_DTYPES,
    SPECULATIVE_METHODS,
    WEIGHT_DTYPES,
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from sparsekv.kv_cache.quant import KV_CACHE_DTYPES
from sparsekv.parallel_config import ROUTING_POLICIES, ParallelConfig

SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "compression": CompressionConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
}
SECTION_TITLES = {
    "model": "model (weights and precision)",
    "cache": "cache (paged KV memory, prefix caching, KV quantization)",
    "compression": "compression (default per-layer KV compression policy)",
    "scheduler": "scheduler (continuous batching and preemption)",
    "parallel": "parallel (tensor-parallel ranks, replicas on Ray Serve, request routing)",
    "speculative": "speculative decoding (draft tokens verified in one target step)",
}

# Flag names that are not the field name in kebab case.
FLAG_NAMES = {
    ("compression", "method"): "kv-compression",
    ("compression", "budget"): "kv-budget",
    ("compression", "compression_ratio"): "kv-compression-ratio",
    ("compression", "head_budgets"): "kv-head-budgets",
    ("compression", "layer_scores"): "kv-layer-scores",
    ("speculative", "method"): "speculative-method",
    ("speculative", "draft_sink_tokens"): "speculative-draft-sink-tokens",
    ("speculative", "draft_recent_tokens"): "speculative-draft-recent-tokens",
    ("speculative", "draft_vocab_size"): "speculative-draft-vocab-size",
}
CHOICES = {
    ("compression", "method"): COMPRESSION_METHODS,
    ("compression", "pooling"): ("max", "avg", "none"),
    ("compression", "gqa_agg"): ("mean", "max"),
    ("compression", "chunked_mode"): ("exact", "bounded"),
    ("compression", "scope"): ("prompt", "context"),
    ("compression", "head_budgets"): HEAD_BUDGETS,
    ("compression", "layer_scores"): LAYER_SCORES,
    ("scheduler", "preemption_mode"): ("swap", "recompute"),
    ("model", "dtype"): ("auto", "bfloat16", "float32"),
    ("model", "attention_backend"): ATTENTION_BACKENDS,
    ("model", "weight_dtype"): WEIGHT_DTYPES,
    ("model", "prefill_qk_dtype"): PREFILL_QK_DTYPES,
    ("cache", "kv_cache_dtype"): KV_CACHE_DTYPES,
    ("parallel", "routing_policy"): ROUTING_POLICIES,
    ("speculative", "method"): SPECULATIVE_METHODS,
}
METAVARS = {
    ("model", "model"): "NAME|PATH",
    ("model", "served_model_name"): "NAME",
    ("cache", "kv_cache_memory"): "GIB",
    ("cache", "gpu_memory_utilization"): "FRACTION",
    ("model", "device"): "auto|cpu|cuda[:N]",
    ("cache", "kv_cache_full_precision_layers"): "L0,L1,...",
    ("compression", "layer_budgets"): "B0,B1,...",
    ("compression", "layer_fractions"): "F0,F1,...",
    ("compression", "compression_ratio"): "R",
    ("parallel", "ray_address"): "HOST:PORT",
    ("parallel", "tensor_parallel_timeout"): "SECONDS",
}
# What a ``None`` default means, for the help line.
NONE_DEFAULTS = {
    ("model", "served_model_name"): "the built-in name or the file stem",
    ("model", "max_model_len"): "the model's own",
    ("cache", "kv_cache_full_precision_layers"): "none",
    ("cache", "num_pages"): "derived from --kv-cache-memory",
    ("cache", "kv_cache_memory"): "sized from the device; 2 GiB on CPU",
    ("compression", "compression_ratio"): "unset",
    ("compression", "layer_budgets"): "unset",
    ("compression", "layer_fractions"): "unset",
    ("parallel", "threads_per_rank"): "the cores divided by the replicas or ranks",
    ("parallel", "ray_address"): "a local cluster",
    ("speculative", "method"): "off",
}
SKIPPED = {("model", "seed"), ("compression", "context_tokens")}


class _DefaultBudget(int):
    """The budget flag's default (1024): an ``int`` that remembers it was not given, so that
    ``--kv-compression-ratio`` alone replaces it while ``--kv-budget`` with the ratio is an
    error."""


class OnOffFlag(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag`` whose help carries our own default text (Python 3.11's
    BooleanOptionalAction appends ``(default: True)`` itself, 3.13's does not)."""

    def __init__(self, *args, help: str | None = None, **kwargs) -> None:  # noqa: A002
        super().__init__(*args, help=None, **kwargs)
        self.help = help


def flag_name(section: str, field_name: str) -> str:
    """``--kv-budget`` style flag name (without dashes) of a config field."""
    if (section, field_name) in FLAG_NAMES:
        return FLAG_NAMES[(section, field_name)]
    prefix = "kv-" if section == "compression" else ""
    return prefix + field_name.replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its text under ``Attributes:`` in ``cls``'s docstring, on one line and
    without reStructuredText markup."""
    docs: dict[str, str] = {}
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Attributes:" not in lines:
        return docs
    current = None
    for line in lines[lines.index("Attributes:") + 1 :]:
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif line.startswith("        ") and current:
            docs[current] += " " + line.strip()
        elif line.strip():
            break
    return {name: text.replace("``", "") for name, text in docs.items()}


def first_sentence(text: str) -> str:
    """The text up to its first full stop that ends a sentence."""
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s+(?=[A-Z0-9(])|$)", text)
    return text[: match.start() + 1] if match else text


def _base_type(annotation) -> type:
    """``int`` for ``int | None``, ``tuple`` for ``tuple[int, ...] | None``, and so on."""
    if typing.get_origin(annotation) is tuple:
        return tuple
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


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError("expected a comma-separated list of numbers") from exc


def _default_text(key: tuple[str, str], default) -> str:
    if default is None:
        return NONE_DEFAULTS.get(key, "unset")
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return "%(default)s"  # argparse fills it in, after any parser.set_defaults


def _metavar(key: tuple[str, str], kind: type) -> str | None:
    if key in METAVARS:
        return METAVARS[key]
    if key in CHOICES:
        return None  # argparse shows {a,b,c}
    return {int: "N", float: "X"}.get(kind, key[1].upper())


_MESSAGE_FIELD = re.compile(r"(kv_compression\.|compression\.)?([a-z][a-z0-9_]*)\b")


def flag_of_error(message: str) -> str | None:
    """The ``--flag`` that sets the field an error message starts with (``kv_compression.budget
    (16) must be ...`` -> ``--kv-budget``), or ``None`` where it names no engine flag."""
    match = _MESSAGE_FIELD.match(message)
    if match is None:
        return None
    compression, name = match.groups()
    sections = ["compression"] if compression else list(SECTIONS)
    for section in sections:
        names = {f.name for f in dataclasses.fields(SECTIONS[section])}
        if name in names and (section, name) not in SKIPPED:
            return "--" + flag_name(section, name)
    return None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field, grouped by section; defaults are the dataclass defaults."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(SECTION_TITLES[section])
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = (section, f.name)
            if key in SKIPPED:
                continue
            dest = f"{section}__{f.name}"
            flag = "--" + flag_name(section, f.name)
            default = f.default
            text = first_sentence(docs.get(f.name, "")).replace("%", "%%")
            help_text = f"{text} (default: {_default_text(key, default)})".lstrip()
            if key == ("compression", "budget"):
                default = _DefaultBudget(default)
                help_text = f"{text} (default: %(default)s; replaced by --kv-compression-ratio)"
            kind = _base_type(hints[f.name])
            if f.name == "decode_eviction":
                group.add_argument(
                    flag, dest=dest, type=_on_off, default=default, metavar="{on,off}",
                    help=help_text,
                )  # fmt: skip
            elif kind is bool:
                group.add_argument(
                    flag, dest=dest, action=OnOffFlag, default=default, help=help_text
                )
            elif kind is tuple:
                floats = float in typing.get_args(typing.get_args(hints[f.name])[0])
                group.add_argument(
                    flag, dest=dest, type=_float_list if floats else _int_list, default=default,
                    metavar=_metavar(key, kind), help=help_text,
                )  # fmt: skip
            else:
                group.add_argument(
                    flag, dest=dest, type=kind, default=default, choices=CHOICES.get(key),
                    metavar=_metavar(key, kind), help=help_text,
                )  # fmt: skip
        if section == "compression":
            group.add_argument(
                "--kv-layer-budgets-file", dest="kv_layer_budgets_file", default=None,
                metavar="PATH",
                help="per-layer budgets from a JSON file (`sparsekv calibrate` writes one: "
                "fractions or token counts per layer) (default: unset)",
            )  # fmt: skip


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build and validate an ``EngineConfig`` from parsed flags.

    Raises:
        ValueError: an invalid value or combination (e.g. both --kv-budget and
            --kv-compression-ratio), naming the parameter.
    """
    values: dict[str, dict] = {section: {} for section in SECTIONS}
    for key, value in vars(args).items():
        if "__" in key:
            section, name = key.split("__", 1)
            if section in values:
                values[section][name] = value
    compression = values["compression"]
    budget = compression.get("budget")
    if isinstance(budget, _DefaultBudget):
        given_ratio = compression.get("compression_ratio") is not None
        compression["budget"] = None if given_ratio else int(budget)
    path = getattr(args, "kv_layer_budgets_file", None)
    if path is not None:
        _apply_budgets_file(compression, path)
    config = EngineConfig(**{s: SECTIONS[s](**v) for s, v in values.items()})
    config.validate()
    return config


def _apply_budgets_file(compression: dict, path: str) -> None:
    """Set ``layer_fractions`` or ``layer_budgets`` from a budgets file.

    Raises:
        ValueError: an invalid file, or budgets also given by flag.
    """
    from sparsekv.compression.budgets_file import load_budgets

    if compression.get("layer_budgets") is not None or compression.get("layer_fractions"):
        raise ValueError(
            "kv_layer_budgets_file: exclusive with --kv-layer-budgets and --kv-layer-fractions"
        )
    budgets = load_budgets(path)
    field_name = "layer_fractions" if budgets.kind == "fractions" else "layer_budgets"
    compression[field_name] = tuple(budgets.budgets)
