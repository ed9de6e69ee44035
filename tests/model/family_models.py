"""Tiny random-weight models of every supported family, and the engine helpers their tests share.

Each config is fp32, a few layers, hidden 64, a 512-word vocabulary, and puts the family's
variant where a 100-token prompt exercises it: sliding windows of 16, RoPE scalings whose
original context is 32 or 64 tokens, soft-caps small enough to bind on random weights.
"""

from __future__ import annotations

import functools
import types

import torch
import transformers
from transformers import PreTrainedTokenizerFast

from sparsekv.config import (
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from sparsekv.engine.engine_setup import build_engine_parts
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.sampling_params import SamplingParams

VOCAB = 512
WINDOW = 16
ATOL = 1e-3
S, F = "sliding_attention", "full_attention"

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
    eos_token_id=1,
    bos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _llama_rope(rope_type: str, **extra) -> dict:
    return {"rope_type": rope_type, "rope_theta": 10_000.0, **extra}


# name -> (transformers config class, overrides, engine max_model_len or None).
FAMILY_CONFIGS: dict[str, tuple[str, dict, int | None]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            rope_parameters=_llama_rope(
                "llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
        None,
    ),
    "llama-linear": ("LlamaConfig", dict(rope_parameters=_llama_rope("linear", factor=2.0)), None),
    "llama-yarn": (
        "LlamaConfig",
        dict(rope_parameters=_llama_rope("yarn", factor=4.0, original_max_position_embeddings=32)),
        None,
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), None),
    "qwen2-untied": ("Qwen2Config", dict(), None),
    "qwen3": ("Qwen3Config", dict(head_dim=32, num_key_value_heads=1), None),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), None),
    "phi3-short": ("Phi3Config", dict(), 64),
    "phi3-long": ("Phi3Config", dict(), None),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=[S, F, S],
            attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            initializer_range=0.2,
        ),
        None,
    ),
}


def _phi3_rope(rotary_dim: int) -> dict:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 0.7 * i for i in range(half)],
    }


def tiny_config(name: str):
    """The tiny transformers config of family case ``name`` (eager attention)."""
    class_name, overrides, _ = FAMILY_CONFIGS[name]
    values = {**_COMMON, **overrides}
    if class_name == "Phi3Config":
        values.update(
            max_position_embeddings=256, original_max_position_embeddings=64, sliding_window=None
        )
        values["rope_parameters"] = _phi3_rope(64 // 4 // 2)
    config = getattr(transformers, class_name)(**values)
    config._attn_implementation = "eager"
    return config


def max_model_len(name: str) -> int | None:
    """The engine's ``max_model_len`` for case ``name`` (``None``: the config's)."""
    return FAMILY_CONFIGS[name][2]


@functools.cache
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``VOCAB`` made-up words (the engine only decodes)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {f"w{i}": i for i in range(VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w1", bos_token="w2")


def random_hf_model(config, seed: int = 0):
    """HF reference with random weights, norms and biases included (HF starts them at
    identity / zero, which would hide a missing norm or bias)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.3)
    return model


def checkpoint_of(model, config=None):
    """A loader ``Checkpoint``-like namespace for an HF model."""
    return types.SimpleNamespace(
        name="tiny",
        path=None,
        hf_config=config or model.config,
        tokenizer=tiny_tokenizer(),
        state_dict=model.state_dict(),
    )


def make_engine(checkpoint, max_len=None, max_num_batched_tokens=4096, block_size=4, **kw):
    """An fp32 engine over ``checkpoint`` (``attention_backend=`` picks the backend)."""
    config = EngineConfig(
        model=ModelConfig(
            dtype="float32",
            max_model_len=max_len,
            attention_backend=kw.pop("attention_backend", "auto"),
        ),
        cache=CacheConfig(
            kv_cache_memory=0.01,
            block_size=block_size,
            enable_prefix_caching=kw.pop("prefix_caching", True),
        ),
        compression=kw.pop("compression", CompressionConfig(method="none")),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, watermark_pages=0, **kw
        ),
    )
    return LLMEngine(config, build_engine_parts(config, checkpoint))


def generate(engine, prompts: list[list[int]], max_tokens: int):
    """Greedy generation of all prompts together; per prompt ``(tokens, logits [n, vocab])``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, collect_logits=True)
        requests[f"r{i}"] = engine._groups[f"r{i}"].samples[0].request
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    return [
        (finished[f"r{i}"].outputs[0].token_ids, torch.stack(requests[f"r{i}"].logits))
        for i in range(len(prompts))
    ]


@torch.no_grad()
def teacher_forced_logits(hf_model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """HF logits ``[len(generated), vocab]`` at the positions that produced ``generated``."""
    ids = torch.tensor([prompt + generated])
    return hf_model(ids).logits[0, len(prompt) - 1 : -1].float()


def random_prompts(lengths, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=generator).tolist() for n in lengths]
