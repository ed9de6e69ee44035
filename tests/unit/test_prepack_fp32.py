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


@pytest.fixture(autouse=True)
def fp32_packing_on(monkeypatch):
    """The suite turns fp32 packing off (tests/conftest.py); these tests are about it."""
    monkeypatch.setenv(prepack.FP32_PREPACK_ENV, "1")
    if not prepack.can_prepack(torch.float32, "cpu", False):
        pytest.skip("no oneDNN packing ops in this PyTorch build")


def test_which_dtype_packs_on_which_cpu(monkeypatch):
    assert prepack.can_prepack(torch.bfloat16, "cpu", True)
    assert prepack.can_prepack(torch.float32, "cpu", False)
    assert not prepack.can_prepack(torch.float32, "cpu", True)  # fp32 on a bf16 CPU: plain
    assert not prepack.can_prepack(torch.bfloat16, "cpu", False)
    assert not prepack.can_prepack(torch.float32, "cuda", False)
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv(prepack.FP32_PREPACK_ENV, off)
        assert not prepack.can_prepack(torch.float32, "cpu", False)
        assert prepack.can_prepack(torch.bfloat16, "cpu", True)  # bf16 packing stays


@pytest.mark.parametrize("tied", [True, False])
def test_fp32_layers_pack_except_the_output_head(tied):
    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(300, 64)
    model.proj = nn.Linear(64, 96)
    model.bf16 = nn.Linear(64, 32).bfloat16()
    model.lm_head = nn.Linear(64, 300, bias=False)
    if tied:
        model.lm_head.weight = model.embed.weight
    x = torch.randn(7, 64)
    before = model.proj(x)
    assert prepack.prepack_linears(model, torch.float32) == 1
    assert isinstance(model.proj, prepack.PackedLinear)
    assert type(model.lm_head) is nn.Linear and type(model.bf16) is nn.Linear  # head; other dtype
    after = model.proj(x)
    assert after.dtype == torch.float32 and after.shape == (7, 96)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)  # fp32 rounding apart
    assert prepack.prepack_linears(model, torch.float16) == 0


def test_engine_as_on_a_cpu_without_bf16_generates_the_same_tokens(monkeypatch):
    checkpoint = tiny_checkpoint("qwen2")
    monkeypatch.setattr(engine_setup, "has_native_bf16", lambda: True)  # fp32 stays plain
    plain = engine(checkpoint)
    monkeypatch.setattr(engine_setup, "has_native_bf16", lambda: False)
    packed = engine(checkpoint)
    layers = [m for m in packed.parts.model.modules() if isinstance(m, prepack.PackedLinear)]
    assert len(layers) == 4 * 3  # qkv, o, gate_up, down of 3 layers; not the head
    assert all(m.packed_weight.dtype == torch.float32 for m in layers)
    assert type(packed.parts.model.lm_head) is torch.nn.Linear
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
