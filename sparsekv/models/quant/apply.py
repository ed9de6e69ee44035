"""Swap a built decoder's ``nn.Linear`` layers for packed ones (``--weight-dtype``).

``gguf`` takes each linear's weight from the checkpoint's raw GGUF blocks (through the same
name table the dense loader walks, so fused QKV / gate-up projections collect their split
parts); ``int8`` quantizes every linear weight per output channel (``w8a8`` too, and its
prefill-sized matmuls quantize activations per row: ``QuantizedLinear``; to 7 bits where the
int8 GEMM saturates, ``int8_rows.int8_gemm_saturates``); ``bf16`` stores them
as bf16 rows. Embeddings and norms stay dense; so does a linear whose weight the file keeps in a
format the kernels do not read (logged). In a bf16 model on a CPU whose packed-weight kernels
run a variant of ``ops.X16_VARIANTS`` (``avx512_amx``, ``avx512_vnni``, ``avx2``), Q4_0 / Q4_1
/ Q8_0 weights with a multiple of 16 output features are repacked to their x16 group layouts
(``ops.repack_x16``: same values, same bytes, about 2x faster decode matmuls).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter

import torch
from torch import nn

from sparsekv.models.prepack import PackedLinear
from sparsekv.models.quant import int8_rows, ops
from sparsekv.models.quant.formats import X16_FORMATS, PackedTensor, pack_bf16, quantize_int8
from sparsekv.models.quant.linear import QuantizedLinear
from sparsekv.models.weights import source_forms

logger = logging.getLogger(__name__)

_EMBEDDING = "model.embed_tokens.weight"


def apply_weight_dtype(model: nn.Module, weight_dtype: str, checkpoint=None) -> int:
    """Pack ``model``'s linear layers in place as ``weight_dtype`` asks.

    Args:
        model: a built ``DecoderForCausalLM`` with its dense weights loaded.
        weight_dtype: ``auto`` (nothing to do), ``bf16``, ``int8``, ``w8a8`` or ``gguf``.
        checkpoint: the ``sparsekv.loader.Checkpoint`` it was loaded from (``gguf``: its
            ``packed_weights``).

    Returns:
        The number of linear layers replaced.

    Raises:
        ValueError: ``weight_dtype`` is unknown, or ``gguf`` with a checkpoint not loaded from
            a GGUF file with ``weight_dtype="gguf"``. A GGUF file whose linear weights are all in
            other types (F16, K-quants) loads dense, with a warning.
    """
    if weight_dtype == "auto":
        return 0
    if weight_dtype == "gguf":
        packed = getattr(checkpoint, "packed_weights", None) or {}
        file_dense = getattr(checkpoint, "dense_linear_weights", None) or []
        if not packed and not file_dense:
            raise ValueError(
                "weight_dtype: gguf needs a GGUF checkpoint loaded with weight_dtype='gguf'; "
                "use int8 or bf16 for other checkpoints"
            )
        embed = model.embed_tokens.weight
        x16 = embed.dtype == torch.bfloat16 and embed.device.type == "cpu" and ops.x16_runs()
        return _pack_gguf(model, packed, file_dense, x16)
    if weight_dtype == "bf16" and model.embed_tokens.weight.dtype == torch.bfloat16:
        return 0  # already bf16: the dense bf16 path (oneDNN / AMX where present) is faster
    if weight_dtype in ("int8", "w8a8", "bf16"):
        pack = pack_bf16 if weight_dtype == "bf16" else quantize_int8
        return _pack_dense(model, pack, w8a8=weight_dtype == "w8a8")
    raise ValueError(
        f"weight_dtype must be one of auto, bf16, int8, w8a8, gguf, got {weight_dtype!r}"
    )


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """(parent, attribute, dotted name, module) of every ``nn.Linear``."""
    return [
        (parent, child_name, f"{prefix}.{child_name}" if prefix else child_name, child)
        for prefix, parent in model.named_modules()
        for child_name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]


def _pack_gguf(
    model: nn.Module, packed: dict[str, PackedTensor], file_dense: list[str], x16: bool
) -> int:
    counts: Counter[str] = Counter()
    dense, replaced = [], 0
    tied = getattr(model.variant, "tie_word_embeddings", False)
    for parent, attribute, name, linear in _linears(model):
        parts = _gguf_parts(name + ".weight", packed, tied)
        if parts is None:
            dense.append(name)
            continue
        if x16:
            parts = [_to_x16(p) for p in parts]
        setattr(parent, attribute, QuantizedLinear(parts, linear.bias))
        counts.update(p.format for p in parts)
        replaced += 1
    log = logger.info if replaced else logger.warning
    log(
        "weight_dtype gguf: %d linear layers packed (tensors: %s); dense: embeddings, norms%s",
        replaced,
        ", ".join(f"{n} {fmt}" for fmt, n in sorted(counts.items())),
        "".join(f", {n}" for n in dense + file_dense),
    )
    return replaced


def _to_x16(part: PackedTensor) -> PackedTensor:
    """``part`` in its x16 group layout where it has one and 16 divides its rows."""
    if part.format in X16_FORMATS and part.shape[0] % 16 == 0:
        return ops.repack_x16(part)
    return part


def _gguf_parts(param: str, packed: dict[str, PackedTensor], tied: bool):
    """The packed row blocks of decoder parameter ``param``, or ``None`` if any part is not
    packed (then the layer stays dense)."""
    if param == "lm_head.weight" and "lm_head.weight" not in packed and tied:
        return [packed[_EMBEDDING]] if _EMBEDDING in packed else None
    found = source_forms(param)
    if found is None:
        return None
    for names in found[1]:
        if all(n in packed for n in names):
            return [packed[n] for n in names]
    return None


def _pack_dense(model: nn.Module, pack, w8a8: bool = False) -> int:
    # The output head keeps unquantized activations (as in vLLM's and SmoothQuant's W8A8): its
    # many-row calls (prompt logprobs, verification) produce the logits.
    # Where oneDNN's int8 GEMM saturates, the layers that feed it get 7-bit codes (the only
    # ones it multiplies exactly); the output head keeps 8 bits.
    seven_bit = w8a8 and int8_rows.int8_gemm_saturates()
    rows_pack = (
        functools.partial(pack, code_max=int8_rows.SATURATING_GEMM_CODE_MAX) if seven_bit else pack
    )
    with torch.no_grad():
        for parent, attribute, name, linear in _linears(model):
            rows = w8a8 and name != "lm_head"
            weight = (rows_pack if rows else pack)(linear.weight)
            setattr(parent, attribute, QuantizedLinear([weight], linear.bias, int8_rows=rows))
    count = _count(model)
    logger.info(
        "weight_dtype: %d linear layers packed%s; embeddings and norms stay dense",
        count,
        " (7-bit codes: this CPU's int8 GEMM saturates)" if seven_bit else "",
    )
    return count


def _count(model: nn.Module) -> int:
    return sum(isinstance(m, QuantizedLinear) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights in memory: parameters, the packed layers' buffers and the
    prepacked layers' weights (``PackedLinear.packed_bytes`` and ``plain_tensors``), each
    storage counted once (a tied head shares the embedding's); rotary tables excluded."""
    tensors, total = list(model.parameters()), 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            tensors += list(module.buffers())
        elif isinstance(module, PackedLinear):
            tensors += module.plain_tensors()
            total += module.packed_bytes
    seen = set()
    for tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total
