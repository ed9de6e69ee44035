"""Declarative tables from GGUF tensor names to Hugging Face parameter names.

GGUF names follow llama.cpp's ``gguf-py/gguf/tensor_mapping.py`` (``blk.{layer}.attn_q.weight``);
HF names follow transformers' state dicts of the same family (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Phi3ForCausalLM``, ``Gemma2ForCausalLM``,
``Gemma3ForCausalLM``).
Per-tensor value fixes (llama.cpp's Q/K row permutation, Gemma's ``1 + w`` norms) are named
here and implemented in :mod:`sparsekv.loader.transforms`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Tensors outside the decoder layers, shared by the supported architectures.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # Llama 3.x RoPE scaling as per-frequency factors (no HF tensor: the decoder reads it).
    "rope_freqs.weight": "rope_freqs.weight",
}

# Per-layer suffixes: ``blk.{i}.<gguf suffix>`` -> ``model.layers.{i}.<hf suffix>``.
LLAMA_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Qwen2: Llama's names plus q/k/v biases; Qwen3: plus per-head q/k norms.
QWEN2_LAYER_NAMES = {
    **LLAMA_LAYER_NAMES,
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
QWEN3_LAYER_NAMES = {
    **LLAMA_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

# Phi-3 keeps HF's fused projections: ``attn_qkv`` and ``ffn_up`` (gate and up, gate first).
PHI3_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Gemma 3 has four norms per layer (sandwich norms) and per-head q/k RMSNorms; note that its
# ``ffn_norm`` is the *pre*-feed-forward norm, unlike Llama's.
GEMMA3_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# Gemma 2: Gemma 3's sandwich norms without the per-head q/k norms.
GEMMA2_LAYER_NAMES = {
    name: hf for name, hf in GEMMA3_LAYER_NAMES.items() if "attn_q_norm" not in name
}
del GEMMA2_LAYER_NAMES["attn_k_norm.weight"]

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture maps onto Hugging Face names.

    Attributes:
        layer_names: per-layer GGUF suffix -> HF suffix.
        transforms: (regex on the GGUF name, transform name) pairs; every matching transform
            is applied, in order (names index :data:`sparsekv.loader.transforms.TRANSFORMS`).
        ignored: GGUF tensors with no HF parameter (dropped, e.g. precomputed RoPE factors).
    """

    layer_names: dict[str, str]
    transforms: tuple[tuple[str, str], ...] = ()
    ignored: frozenset[str] = field(default_factory=frozenset)

    def hf_name(self, gguf_name: str) -> str | None:
        """HF parameter name for a GGUF tensor name, or None if the name is unknown."""
        if gguf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[gguf_name]
        match = _LAYER_NAME.fullmatch(gguf_name)
        if match is None or match.group(2) not in self.layer_names:
            return None
        return f"model.layers.{match.group(1)}.{self.layer_names[match.group(2)]}"

    def transforms_for(self, gguf_name: str) -> list[str]:
        """Names of the value transforms that apply to a GGUF tensor."""
        return [name for pattern, name in self.transforms if re.search(pattern, gguf_name)]


ARCHITECTURES = {
    # llama.cpp's convert_hf_to_gguf.py permutes Q and K rows (interleaved RoPE pairs) for Llama
    # (and Mistral, which it writes as ``llama``), biases included.
    "llama": ArchSpec(
        layer_names=QWEN2_LAYER_NAMES,
        transforms=(
            (r"\.attn_q\.(weight|bias)$", "unpermute_q"),
            (r"\.attn_k\.(weight|bias)$", "unpermute_k"),
        ),
    ),
    # Qwen2 / Qwen3 / Phi-3: HF's half-split RoPE layout is kept (no permutation).
    "qwen2": ArchSpec(layer_names=QWEN2_LAYER_NAMES),
    "qwen3": ArchSpec(layer_names=QWEN3_LAYER_NAMES),
    # The longrope factors become the config's rope_parameters (``gguf_config.py``).
    "phi3": ArchSpec(
        layer_names=PHI3_LAYER_NAMES,
        ignored=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
    ),
    "gemma2": ArchSpec(
        layer_names=GEMMA2_LAYER_NAMES,
        transforms=((r"norm\.weight$", "subtract_one"),),
    ),
    # Gemma 3: no Q/K permutation (its converter keeps HF's half-split RoPE layout), but every
    # RMSNorm weight (including q_norm / k_norm and the final norm) is stored as 1 + w.
    "gemma3": ArchSpec(
        layer_names=GEMMA3_LAYER_NAMES,
        transforms=((r"norm\.weight$", "subtract_one"),),
    ),
}
