"""GGUF files written by llama.cpp's own converter (an independent writer) load per family.

The fixtures (``fixtures/gguf``, rebuilt by ``make_fixtures.py``) are tiny random HF folders
and the GGUF files ``convert_hf_to_gguf.py`` made of them. Per family: the GGUF loads to exactly
the HF folder's tensors (llama.cpp's Q/K permutation undone, fused Phi-3 projections kept), and
a model built from the GGUF gives transformers' logits on the HF folder (so what the GGUF keeps
outside the tensors, Llama 3's ``rope_freqs`` and Phi-3's longrope factors and partial rotary,
and Gemma 2's soft-caps and window, is read back too).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from sparsekv.loader import load_checkpoint
from sparsekv.models.registry import build_model
from tests.model.dense_reference import DenseMaskedAttention

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
CASES = ["llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma2"]
# Gemma 2: llama.cpp stores ``1 + w`` norms and the soft-caps under its own keys.
# Phi-3's longrope: a max_model_len within the original 64 tokens keeps the short factors.
MAX_LEN = {"phi3": 64}


@pytest.fixture(scope="module", params=CASES)
def case(request):
    name = request.param
    return name, load_checkpoint(str(FIXTURES / f"{name}.gguf"), torch.float32)


def test_gguf_loads_the_hf_folders_tensors(case):
    name, checkpoint = case
    hf = load_file(FIXTURES / name / "model.safetensors")
    extra = {"rope_freqs.weight"} if name == "llama3" else set()
    assert set(checkpoint.state_dict) == set(hf) | extra
    for key, tensor in hf.items():
        assert torch.equal(checkpoint.state_dict[key], tensor.float()), key


def test_model_from_gguf_matches_hf_on_the_folder(case):
    name, checkpoint = case
    config = checkpoint.hf_config
    model = build_model(config, checkpoint.state_dict, torch.float32, "cpu", MAX_LEN.get(name))
    hf_model = AutoModelForCausalLM.from_pretrained(
        FIXTURES / name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = torch.randint(3, config.vocab_size, (50,), generator=torch.Generator().manual_seed(3))
    layers = len(model.layers)
    dense = DenseMaskedAttention(
        layers, [None] * layers, 1, 4, 50, logit_softcap=model.attn_logit_softcap
    )
    with torch.inference_mode():
        ours = model.compute_logits(model(prompt, torch.arange(50), dense))
        expected = hf_model(prompt[None]).logits[0].float()
    torch.testing.assert_close(ours, expected, atol=1e-3, rtol=0)
    assert (expected - expected.mean()).abs().max() > 0.1  # logits that can disagree


def test_llama3_gguf_rope_freqs_are_the_hf_scaling():
    """Without ``rope_freqs`` the GGUF's config alone would give plain RoPE."""
    name = "llama3"
    checkpoint = load_checkpoint(str(FIXTURES / f"{name}.gguf"), torch.float32)
    model = build_model(checkpoint.hf_config, checkpoint.state_dict, torch.float32, "cpu")
    hf_model = AutoModelForCausalLM.from_pretrained(FIXTURES / name, dtype=torch.float32)
    expected = hf_model.model.rotary_emb.inv_freq
    torch.testing.assert_close(model.rotary["full_attention"].inv_freq, expected)
    assert checkpoint.hf_config.rope_parameters["rope_type"] == "default"
