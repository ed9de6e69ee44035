"""fp32 weight prepacking (``models.prepack``) on CPUs without native bf16, where ``--dtype
auto`` runs fp32: which layers are packed, results within fp32 rounding of ``nn.Linear``, and
an engine built as on such a CPU generating the unpacked engine's tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsekv.engine import engine_setup
from sparsekv.models import prepack
from sparsekv.sampling_params import SamplingParams
from tests.model.spec_models import engine, tiny_checkpoint

pytestmark = pytest.mark.skipif(
    not prepack.can_prepack(torch.float32, "cpu", False), reason="no oneDNN packing ops"
)


def test_which_dtype_packs_on_which_cpu():
    assert prepack.can_prepack(torch.bfloat16, "cpu", True)
    assert prepack.can_prepack(torch.float32, "cpu", False)
    assert not prepack.can_prepack(torch.float32, "cpu", True)  # fp32 on a bf16 CPU: plain
    assert not prepack.can_prepack(torch.bfloat16, "cpu", False)
    assert not prepack.can_prepack(torch.float32, "cuda", False)


def test_fp32_layers_pack_except_a_tied_head():
    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(300, 64)
    model.proj = nn.Linear(64, 96)
    model.head = nn.Linear(64, 300, bias=False)
    model.head.weight = model.embed.weight  # tied
    x = torch.randn(7, 64)
    before = model.proj(x)
    assert prepack.prepack_linears(model) == 1
    assert isinstance(model.proj, prepack.PackedLinear) and type(model.head) is nn.Linear
    after = model.proj(x)
    assert after.dtype == torch.float32 and after.shape == (7, 96)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)  # fp32 rounding apart


def test_engine_as_on_a_cpu_without_bf16_generates_the_same_tokens(monkeypatch):
    checkpoint = tiny_checkpoint("qwen2")
    plain = engine(checkpoint)
    monkeypatch.setattr(engine_setup, "has_native_bf16", lambda: False)
    packed = engine(checkpoint)
    layers = [m for m in packed.parts.model.modules() if isinstance(m, prepack.PackedLinear)]
    assert layers and all(m.packed_weight.dtype == torch.float32 for m in layers)
    assert not any(isinstance(m, prepack.PackedLinear) for m in plain.parts.model.modules())
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 45))
    outputs = []
    for eng in (plain, packed):
        eng.add_request("r", prompt, params)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    outputs.append(out.outputs[0].token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12
