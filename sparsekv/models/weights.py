"""Hugging Face state dicts -> the decoder's parameters, from one declarative table.

Every family stores the same tensors under transformers' names, split or fused: Llama, Qwen,
Mistral and Gemma keep ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj``,
Phi-3 stores ``qkv_proj`` and ``gate_up_proj`` already fused. A row of :data:`LAYER_WEIGHTS`
names one decoder parameter and its HF sources, fused first; the loader takes the first form
the checkpoint holds, checks each source's shape and concatenates split ones (rows, dim 0).
Which rows a model needs follows from its own parameters (biases, q/k norms and sandwich norms
exist only where its ``DecoderVariant`` asks for them). GGUF files reach this table after
``sparsekv.loader`` renamed their tensors to these HF names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

# llama.cpp's precomputed RoPE frequency factors (Llama 3.x GGUF files); not an HF tensor.
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class WeightRow:
    """One decoder parameter and where a checkpoint keeps it.

    Attributes:
        sources: alternative HF forms, each a tuple of suffixes concatenated along dim 0
            (one name: stored fused).
        split: how the parameter divides into a split form's parts: ``qkv`` (query, key, value
            heads) or ``halves`` (gate, up); ``None`` for single tensors.
    """

    sources: tuple[tuple[str, ...], ...]
    split: str | None = None


def _fused(fused: str, parts: tuple[str, ...], kind: str, split: str) -> WeightRow:
    return WeightRow(((f"{fused}.{kind}",), tuple(f"{p}.{kind}" for p in parts)), split)


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")

# Decoder parameter suffix (under ``layers.{i}.``) -> its HF sources (under ``model.layers.{i}.``).
LAYER_WEIGHTS: dict[str, WeightRow] = {
    "self_attn.qkv_proj.weight": _fused("self_attn.qkv_proj", _QKV, "weight", "qkv"),
    "self_attn.qkv_proj.bias": _fused("self_attn.qkv_proj", _QKV, "bias", "qkv"),
    "mlp.gate_up_proj.weight": _fused("mlp.gate_up_proj", _GATE_UP, "weight", "halves"),
    "mlp.gate_up_proj.bias": _fused("mlp.gate_up_proj", _GATE_UP, "bias", "halves"),
    **{
        name: WeightRow(((name,),))
        for name in (
            "self_attn.o_proj.weight",
            "self_attn.o_proj.bias",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.down_proj.weight",
            "mlp.down_proj.bias",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "pre_feedforward_layernorm.weight",
            "post_feedforward_layernorm.weight",
        )
    },
}

# Parameters outside the layers -> HF name.
GLOBAL_WEIGHTS = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Multimodal checkpoints keep the text model under this prefix.
_TEXT_PREFIX = "model.language_model."


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a HF state dict into ``model`` (a ``DecoderForCausalLM``), in place.

    Tensors the model has no parameter for (rotary buffers, a tied ``lm_head.weight``) are
    ignored; llama.cpp's ``rope_freqs.weight`` sets the RoPE frequencies.

    Raises:
        ValueError: a tensor is missing or has the wrong shape; the message names the family,
            the HF tensor and the decoder parameter it is for.
    """
    family = model.variant.family
    state_dict = _strip_text_prefix(state_dict)
    if model.variant.tie_word_embeddings:
        # Building on the meta device and ``to_empty`` make new parameters: tie them again.
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = _source_tensor(model, family, name, param, state_dict)
            param.copy_(tensor)
    if ROPE_FREQS in state_dict:
        # Llama 3.x scaling, precomputed for the full-attention frequencies.
        rope = model.rotary["full_attention"] if "full_attention" in model.rotary else None
        for module in model.rotary.values():
            if rope is None or module is rope:
                module.set_freq_factors(state_dict[ROPE_FREQS])


def source_forms(name: str) -> tuple[WeightRow, list[list[str]]] | None:
    """The table row of decoder parameter ``name`` and its HF source forms with their full
    names (fused first, each a list concatenated along dim 0); ``None`` for an unknown name."""
    match = _LAYER.fullmatch(name)
    if match is None:
        if name not in GLOBAL_WEIGHTS:
            return None
        row, prefix = WeightRow(((GLOBAL_WEIGHTS[name],),)), ""
    else:
        if match.group(2) not in LAYER_WEIGHTS:
            return None
        row, prefix = LAYER_WEIGHTS[match.group(2)], f"model.layers.{match.group(1)}."
    return row, [[prefix + source for source in form] for form in row.sources]


def _source_tensor(model, family: str, name: str, param, state_dict) -> torch.Tensor:
    """The HF tensor(s) of decoder parameter ``name``, shape-checked and concatenated."""
    found = source_forms(name)
    if found is None:
        raise ValueError(f"model: {family}: no checkpoint tensor is known for {name}")
    row, forms = found
    for names in forms:
        if all(n in state_dict for n in names):
            break
    else:
        missing = [n for n in names if n not in state_dict]  # of the split (last) form
        raise ValueError(
            f"model: {family} checkpoint lacks tensor {missing[0]!r} (for {name}, "
            f"shape {tuple(param.shape)})"
        )
    shapes = _part_shapes(model, row.split if len(names) > 1 else None, param.shape)
    parts = []
    for source, shape in zip(names, shapes):
        tensor = state_dict[source]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"model: {family} tensor {source!r} has shape {tuple(tensor.shape)}, "
                f"expected {shape} (for {name})"
            )
        parts.append(tensor)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _part_shapes(model, split: str | None, shape: torch.Size) -> list[tuple[int, ...]]:
    """Shapes of the split parts of a parameter of ``shape`` (dim 0 divided)."""
    rest = tuple(shape[1:])
    if split is None:
        return [tuple(shape)]
    if split == "halves":
        return [(shape[0] // 2, *rest)] * 2
    d = model.head_dim
    q, kv = model.num_heads * d, model.num_kv_heads * d
    return [(q, *rest), (kv, *rest), (kv, *rest)]


def _strip_text_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map ``model.language_model.X`` (multimodal checkpoints) to ``model.X``."""
    if not any(name.startswith(_TEXT_PREFIX) for name in state_dict):
        return state_dict
    return {
        ("model." + name[len(_TEXT_PREFIX) :] if name.startswith(_TEXT_PREFIX) else name): tensor
        for name, tensor in state_dict.items()
    }
