"""``weight_bytes``: the model's weights in memory, prepacked bf16 layers included (oneDNN's
packed weight at its logical size, plus the plain weight a layer keeps for its native kernels),
each storage counted once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsekv.models import prepack
from sparsekv.models.quant.apply import weight_bytes


class TiedModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, inner: int, bias: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden).bfloat16()
        self.proj = prepack.PackedLinear(nn.Linear(hidden, inner, bias=bias).bfloat16())
        head = nn.Linear(hidden, vocab, bias=False).bfloat16()
        head.weight = self.embed.weight
        self.head = prepack.PackedLinear(head, shared_weight=True)


@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_layers_count_their_packed_and_plain_weights(bias):
    if not prepack.can_prepack(torch.bfloat16, "cpu", True):
        pytest.skip("no oneDNN bf16 packing in this PyTorch build")
    model = TiedModel(vocab=256, hidden=64, inner=96, bias=bias)
    embed = 256 * 64 * 2
    proj_packed, head_packed = 64 * 96 * 2, 64 * 256 * 2
    # a layer with a bias keeps no plain weight; the head's plain weight is the embedding's
    proj_plain = 0 if bias or model.proj._plain_weight is None else 64 * 96 * 2
    expected = embed + proj_packed + head_packed + proj_plain + (96 * 2 if bias else 0)
    assert weight_bytes(model) == expected
    assert model.head._plain_weight is None or (
        model.head._plain_weight.data_ptr() == model.embed.weight.data_ptr()
    )


def test_plain_layers_count_each_storage_once():
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = nn.Parameter(model[0].weight.t())  # a view of the same storage
    assert weight_bytes(model) == 4 * (8 * 4 + 4)
