"""Read and check a Hugging Face folder's ``config.json``.

transformers accepts many values the decoder cannot run (a RoPE factor that is a string, a
context of 0 tokens) and refuses others with its own exception types (``huggingface_hub``'s
strict-dataclass errors, a ``TypeError`` from deep inside a RoPE initialiser). The fields the
decoder reads are checked here first, on the file as written, so a bad value is refused as a
``ValueError`` that starts with ``model:`` and names the field and the value; whatever
transformers still refuses is turned into one too. :func:`check_layer_count` compares the
config's layers with the checkpoint's tensors.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Sizes the decoder is built from: integers >= 1 where present.
_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
# The same, ``null`` allowed (transformers derives or disables them).
_OPTIONAL_POSITIVE_INTS = (
    "num_key_value_heads",
    "head_dim",
    "original_max_position_embeddings",
    "sliding_window_pattern",
)
# ``null`` or an integer >= 0 (0: none).
_OPTIONAL_COUNTS = ("sliding_window",)
# Finite numbers > 0 where present.
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "query_pre_attn_scalar")
# Soft-caps: ``null`` or a finite number >= 0 (0 is off).
_SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")
_BOOLS = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "use_bidirectional_attention",
)
_LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' config classes of these model types refuse a width that the heads do not divide,
# even with an explicit head_dim (others only need it to derive head_dim).
_HEADS_DIVIDE_WIDTH = ("llama", "gemma2", "gemma3", "gemma3_text")

_ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)
# Keys each RoPE type's initialiser reads without a default.
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
_ROPE_POSITIVE = ("factor", "rope_theta", "attention_factor", "low_freq_factor", "high_freq_factor")
_ROPE_NUMBERS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")

_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def load_hf_config(folder: str | Path):
    """The text config of ``folder/config.json``, its values checked first.

    Returns:
        transformers' config (a multimodal config's ``text_config``).

    Raises:
        ValueError: (message starts with ``model:``) the file is unreadable or not a JSON
            object, a field the decoder reads has a bad type or value (naming the field and the
            value), or transformers refuses the config (its reason).
    """
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"model: cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"model: {path} holds {type(raw).__name__}, not a JSON object")
    check_config_values(raw, path)
    try:
        config = AutoConfig.from_pretrained(folder)
        return config.get_text_config(decoder=True)
    except (StrictDataclassError, ValueError, TypeError, KeyError, ZeroDivisionError) as exc:
        raise ValueError(f"model: {path} is refused by transformers: {_reason(exc)}") from exc


def check_config_values(raw: dict[str, Any], path: Path | str = "config.json") -> None:
    """Check the fields of a parsed ``config.json`` (its ``text_config`` when it has one).

    Raises:
        ValueError: ``model: <path>: <field> is <value>; <what it must be>``.
    """
    text, prefix = raw, ""
    if isinstance(raw.get("text_config"), dict):
        text, prefix = raw["text_config"], "text_config."

    def bad(field: str, value: Any, expected: str) -> ValueError:
        shown = _json(value)
        return ValueError(f"model: {path}: {prefix}{field} is {shown}; expected {expected}")

    for field in _POSITIVE_INTS + _OPTIONAL_POSITIVE_INTS:
        if field not in text:
            continue
        value = text[field]
        optional = field in _OPTIONAL_POSITIVE_INTS
        if value is None and optional:
            continue
        if not _is_int(value) or value < 1:
            raise bad(field, value, "null or an integer >= 1" if optional else "an integer >= 1")
    for field in _OPTIONAL_COUNTS:
        value = text.get(field)
        if value is not None and (not _is_int(value) or value < 0):
            raise bad(field, value, "null or an integer >= 0")
    for field in _POSITIVE_NUMBERS:
        if field in text and (not _is_number(text[field]) or text[field] <= 0):
            raise bad(field, text[field], "a number > 0")
    for field in _SOFTCAPS:
        value = text.get(field)
        if value is not None and (not _is_number(value) or value < 0):
            raise bad(field, value, "null or a number >= 0")
    for field in _BOOLS:
        value = text.get(field)
        if value is not None and not isinstance(value, bool):
            raise bad(field, value, "true, false or null")
    partial = text.get("partial_rotary_factor")
    if partial is not None and (not _is_number(partial) or not 0 < partial <= 1):
        raise bad("partial_rotary_factor", partial, "a number in (0, 1]")
    _check_layer_types(text, bad)
    _check_heads(text, prefix, path)
    for key in ("rope_scaling", "rope_parameters"):
        if text.get(key) is not None:
            _check_rope(text[key], key, bad)


def check_layer_count(config, state_dict: dict, source: str) -> None:
    """Refuse a checkpoint whose ``model.layers.<i>.`` tensors are not the config's layers.

    Args:
        config: the (text) config; ``num_hidden_layers`` is compared.
        state_dict: HF names -> tensors.
        source: where the layer count came from, for the message (``<folder>/config.json``).

    Raises:
        ValueError: (message starts with ``model:``) tensors of layers past
            ``num_hidden_layers``, or layers below it without any tensor.
    """
    num_layers = config.num_hidden_layers
    held = set()
    for name in state_dict:
        match = _LAYER_TENSOR.match(name)
        if match is not None:
            held.add(int(match.group(1)))
    if not held:
        return  # tensor names the decoder's table reports as missing, naming them
    extra = sorted(i for i in held if i >= num_layers)
    if extra:
        raise ValueError(
            f"model: {source} sets num_hidden_layers {num_layers}, but the checkpoint holds "
            f"weights of {len(held)} layers (also {_layers(extra)}); fix num_hidden_layers or "
            "remove those layers' tensors"
        )
    missing = sorted(set(range(num_layers)) - held)
    if missing:
        raise ValueError(
            f"model: {source} sets num_hidden_layers {num_layers}, but the checkpoint holds no "
            f"weights for {_layers(missing)}"
        )


def _check_layer_types(text: dict, bad) -> None:
    types = text.get("layer_types")
    if types is None:
        return
    if not isinstance(types, list) or any(kind not in _LAYER_TYPES for kind in types):
        raise bad("layer_types", types, f"a list of {' / '.join(_LAYER_TYPES)}")
    layers = text.get("num_hidden_layers")
    if layers is not None and len(types) != layers:
        raise bad("layer_types", types, f"{layers} entries (num_hidden_layers)")


def _check_heads(text: dict, prefix: str, path) -> None:
    width, heads = text.get("hidden_size"), text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(
            f"model: {path}: {prefix}num_attention_heads {heads} is not a multiple of "
            f"{prefix}num_key_value_heads {kv_heads}"
        )
    needs_division = text.get("head_dim") is None or text.get("model_type") in _HEADS_DIVIDE_WIDTH
    if width is not None and heads is not None and needs_division and width % heads:
        raise ValueError(
            f"model: {path}: {prefix}hidden_size {width} is not a multiple of "
            f"{prefix}num_attention_heads {heads}"
        )


def _check_rope(params: Any, key: str, bad) -> None:
    if not isinstance(params, dict):
        raise bad(key, params, "null or an object")
    if any(isinstance(value, dict) for value in params.values()):  # one entry per layer type
        for layer_type, nested in params.items():
            if nested is not None:
                _check_rope(nested, f"{key}.{layer_type}", bad)
        return
    type_key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(type_key, "default")
    if rope_type not in _ROPE_TYPES:
        raise bad(f"{key}.{type_key}", rope_type, f"one of {', '.join(_ROPE_TYPES)}")
    for field in _ROPE_REQUIRED.get(rope_type, ()):
        if field not in params:
            raise bad(key, params, f"an object with {field} (rope type {rope_type!r} needs it)")
    for field in _ROPE_POSITIVE:
        if field in params and (not _is_number(params[field]) or params[field] <= 0):
            raise bad(f"{key}.{field}", params[field], "a number > 0")
    for field in _ROPE_NUMBERS:
        if params.get(field) is not None and not _is_number(params[field]):
            raise bad(f"{key}.{field}", params[field], "a number")
    original = params.get("original_max_position_embeddings")
    if original is not None and (not _is_int(original) or original < 1):
        raise bad(f"{key}.original_max_position_embeddings", original, "an integer >= 1")
    partial = params.get("partial_rotary_factor")
    if partial is not None and (not _is_number(partial) or not 0 < partial <= 1):
        raise bad(f"{key}.partial_rotary_factor", partial, "a number in (0, 1]")
    for field in ("short_factor", "long_factor"):
        value = params.get(field)
        if value is not None and (
            not isinstance(value, list) or not all(_is_number(v) and v > 0 for v in value)
        ):
            raise bad(f"{key}.{field}", value, "a list of numbers > 0")
    if "truncate" in params and not isinstance(params["truncate"], bool):
        raise bad(f"{key}.truncate", params["truncate"], "true or false")


def _layers(indices: list[int]) -> str:
    """``layers 10-29`` for a run, else the first few indices."""
    if len(indices) == 1:
        return f"layer {indices[0]}"
    if indices[-1] - indices[0] == len(indices) - 1:
        return f"layers {indices[0]}-{indices[-1]}"
    shown = ", ".join(str(i) for i in indices[:8])
    return f"layers {shown}{', ...' if len(indices) > 8 else ''}"


def _reason(exc: Exception) -> str:
    """The innermost cause's message: strict-dataclass errors wrap the validator's error."""
    cause = exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ else exc
    text = str(cause).strip() or type(cause).__name__
    return " ".join(text.split())


def _json(value: Any) -> str:
    """A value as config.json spells it (``null``, ``"x"``), shortened past 80 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
