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
    """``linear(x)[..., :num_rows]``, reading only the first ``num_rows`` weight rows where the
    layer type allows it (packed GGUF / int8 rows, a pre-packed bf16 layer that keeps its plain
    weight, a plain ``nn.Linear``); any other module, or one with forward hooks (a
    vocabulary-parallel head gathers its shards in one), computes every output and slices.

    Args:
        linear: the output head (``in_features -> out_features``).
        x: ``[..., in_features]`` in the layer's input dtype.
        num_rows: outputs wanted, in ``[1, out_features]`` (a packed x16 head needs a multiple
            of 16 unless it is ``out_features``).

    Returns:
        ``[..., num_rows]`` in the dtype ``linear(x)`` returns.

    Raises:
        ValueError: ``num_rows`` out of range (or cutting an x16 group of rows).
    """
    if linear._forward_hooks or linear._forward_pre_hooks:
        return linear(x)[..., :num_rows]  # e.g. a vocabulary-parallel head gathering its shards
    if isinstance(linear, QuantizedLinear):
        return linear.leading_rows(num_rows)(x)
    if isinstance(linear, PackedLinear):
        return linear.leading_rows_forward(x, num_rows)
    if type(linear) is nn.Linear:
        if not 1 <= num_rows <= linear.out_features:
            raise ValueError(f"num_rows: must be in [1, {linear.out_features}], got {num_rows}")
        bias = None if linear.bias is None else linear.bias[:num_rows]
        return F.linear(x, linear.weight[:num_rows], bias)
    return linear(x)[..., :num_rows]
