"""Logits over the leading token ids only: the first rows of an output head.

Byte-level BPE vocabularies number tokens in merge order, so low ids are the frequent ones. A
draft that may propose only the first ``n`` ids reads ``n / vocab_size`` of the head's bytes,
which on a small model is a large share of a decode step's weights (SmolLM2-135M: 30 of 96 MB
packed). Restricting a drafter to the frequent part of the vocabulary is the idea of FR-Spec
(Zhao et al., 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling"); EAGLE-3's draft heads keep a reduced vocabulary too.
The target's verification still scores the whole vocabulary, so the output does not change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsekv.models.prepack import PackedLinear
from sparsekv.models.quant.linear import QuantizedLinear


def leading_rows(linear: nn.Module, x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``linear(x)[..., :num_rows]``, reading only the first ``num_rows`` weight rows where
    :func:`reads_leading_rows` says so; otherwise every output is computed and sliced.

    Args:
        linear: the output head (``in_features -> out_features``).
        x: ``[rows, in_features]`` (or ``[..., in_features]``) in the layer's input dtype.
        num_rows: outputs wanted, in ``[1, out_features]`` (a packed x16 head needs a multiple
            of 16 unless it is ``out_features``).

    Returns:
        ``[..., num_rows]`` in the dtype ``linear(x)`` returns.

    Raises:
        ValueError: ``num_rows`` out of range (or cutting an x16 group of rows).
    """
    if not reads_leading_rows(linear, x.shape[0] if x.dim() == 2 else None):
        # every output (a hook may gather shards: the width is the output's, not the layer's)
        out = linear(x)
        _check_rows(num_rows, out.shape[-1])
        return out[..., :num_rows]
    _check_rows(num_rows, linear.out_features)
    if isinstance(linear, QuantizedLinear):
        return linear.leading_rows(num_rows)(x)
    if isinstance(linear, PackedLinear):
        return linear.leading_rows_forward(x, num_rows)
    bias = None if linear.bias is None else linear.bias[:num_rows]
    return F.linear(x, linear.weight[:num_rows], bias)


def reads_leading_rows(linear: nn.Module, rows: int | None) -> bool:
    """Whether :func:`leading_rows` reads only the leading weight rows of ``linear`` for an
    input of ``rows`` rows (``None``: not a 2-D input): packed GGUF / int8 heads and plain
    ``nn.Linear`` heads always; a pre-packed bf16 head where it keeps its plain weight (a tied
    head, or one of at most ``prepack.GEMV_MAX_WEIGHT_BYTES``) and ``rows`` takes its native
    kernels (1 to ``prepack.SMALL_GEMM_MAX_ROWS``); never a head with forward hooks (a
    vocabulary-parallel head gathers its shards in one) or of another type."""
    if linear._forward_hooks or linear._forward_pre_hooks:
        return False
    if isinstance(linear, QuantizedLinear) or type(linear) is nn.Linear:
        return True
    if isinstance(linear, PackedLinear):
        return linear.reads_plain_rows(rows)
    return False


def _check_rows(num_rows: int, width: int) -> None:
    if not 1 <= num_rows <= width:
        raise ValueError(f"num_rows: must be in [1, {width}], got {num_rows}")
