"""Model-family plumbing: load errors name the architecture / tensor / supported list,
``--tokenizer`` replaces the model's tokenizer, ``sparsekv models`` lists every family, and each
family's switches are read from its config."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

from sparsekv.cli import main
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.loader import load_checkpoint
from sparsekv.models.families import FAMILIES, supported_model_types, variant_of
from sparsekv.models.interface import CausalLM
from sparsekv.models.registry import build_model
from tests.model.family_models import random_hf_model, tiny_config, tiny_tokenizer

SUPPORTED = "gemma2, gemma3, gemma3_text, llama, mistral, phi3, qwen2, qwen3"


@pytest.fixture(scope="module")
def qwen2():
    model = random_hf_model(tiny_config("qwen2-untied"))
    return model.config, dict(model.state_dict())


def test_supported_list():
    assert ", ".join(supported_model_types()) == SUPPORTED


def test_unsupported_architecture_names_it_and_the_supported_list():
    with pytest.raises(ValueError) as err:
        build_model(GPT2Config(), {}, torch.float32, "cpu")
    assert str(err.value) == (
        f"model: architecture 'gpt2' is not supported (supported: {SUPPORTED})"
    )


def test_missing_tensor_is_named(qwen2):
    config, state = qwen2
    state = dict(state)
    del state["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError) as err:
        build_model(config, state, torch.float32, "cpu")
    assert str(err.value) == (
        "model: qwen2 checkpoint lacks tensor 'model.layers.1.self_attn.k_proj.bias' "
        "(for layers.1.self_attn.qkv_proj.bias, shape (128,))"
    )


def test_wrong_shape_is_named(qwen2):
    config, state = qwen2
    state = dict(state)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    with pytest.raises(ValueError) as err:
        build_model(config, state, torch.float32, "cpu")
    assert str(err.value) == (
        "model: qwen2 tensor 'model.layers.0.mlp.up_proj.weight' has shape (95, 64), "
        "expected (96, 64) (for layers.0.mlp.gate_up_proj.weight)"
    )


def test_fused_and_split_forms_load_the_same(qwen2):
    """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` names load like the split ones."""
    config, state = qwen2
    fused = dict(state)
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            parts = [fused.pop(f"{attn}{p}_proj.{kind}") for p in "qkv"]
            fused[f"{attn}qkv_proj.{kind}"] = torch.cat(parts)
        parts = [fused.pop(f"{mlp}{p}_proj.weight") for p in ("gate", "up")]
        fused[f"{mlp}gate_up_proj.weight"] = torch.cat(parts)
    split_model = build_model(config, state, torch.float32, "cpu")
    fused_model = build_model(config, fused, torch.float32, "cpu")
    assert isinstance(fused_model, CausalLM)
    for (name, a), (_, b) in zip(split_model.named_parameters(), fused_model.named_parameters()):
        assert torch.equal(a, b), name


def test_family_switches():
    qwen3 = variant_of(tiny_config("qwen3"))
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.num_kv_heads, qwen3.qkv_bias) == (
        True,
        32,
        1,
        False,
    )
    qwen2 = variant_of(tiny_config("qwen2"))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings) == (True, False, True)
    gemma2 = variant_of(tiny_config("gemma2"), max_model_len=512)
    assert gemma2.attn_scale == pytest.approx(24**-0.5)
    assert (gemma2.norm_offset, gemma2.sandwich_norms, gemma2.embedding_scale) == (True,) * 3
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.qk_norm) == (4, 3, False)
    phi3 = variant_of(tiny_config("phi3-long"))
    assert (phi3.rotary_dim, phi3.head_dim, phi3.activation) == (8, 16, "silu")


def test_models_command_lists_every_family(capsys):
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == list(FAMILIES)
    assert "gemma3_text, gemma3" in lines[-1]


def test_tokenizer_flag_replaces_the_models_tokenizer(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--tokenizer", str(tmp_path / "tok")]))
    assert config.model.tokenizer == str(tmp_path / "tok")
    # A random-weight folder without a tokenizer loads with one from elsewhere.
    random_hf_model(tiny_config("llama3")).save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    with pytest.raises(
        ValueError, match="(?s)model: cannot load a tokenizer from .*--tokenizer PATH"
    ):
        load_checkpoint(str(tmp_path / "model"), torch.float32)
    checkpoint = load_checkpoint(
        str(tmp_path / "model"), torch.float32, tokenizer=config.model.tokenizer
    )
    assert checkpoint.tokenizer.convert_tokens_to_ids("w7") == 7
    tokenizer_json = tmp_path / "tok" / "tokenizer.json"
    checkpoint = load_checkpoint(
        str(tmp_path / "model"), torch.float32, tokenizer=str(tokenizer_json)
    )
    assert checkpoint.tokenizer.convert_tokens_to_ids("w9") == 9
    with pytest.raises(ValueError, match="tokenizer: .* is neither a tokenizer folder nor a file"):
        load_checkpoint(str(tmp_path / "model"), torch.float32, tokenizer=str(tmp_path / "nope"))
