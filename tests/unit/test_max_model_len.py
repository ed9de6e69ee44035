"""``--max-model-len`` past the model's context is refused, as vLLM does, unless
``SPARSEKV_ALLOW_LONG_MAX_MODEL_LEN`` is on (then used, with a warning); unset, it is the
model's context."""

from __future__ import annotations

import logging
import types

import pytest

from sparsekv.config import CacheConfig, EngineConfig, ModelConfig
from sparsekv.engine.engine_setup import LONG_MAX_MODEL_LEN, build_engine_parts, model_len_of
from sparsekv.engine.model_len import model_context
from tests.conftest import tiny_checkpoint, tiny_llama_config


def _config(max_model_len: int | None) -> EngineConfig:
    return EngineConfig(model=ModelConfig(dtype="float32", max_model_len=max_model_len))


SMOLLM2 = types.SimpleNamespace(max_position_embeddings=8192)


@pytest.fixture(autouse=True)
def _no_opt_in(monkeypatch):
    monkeypatch.delenv(LONG_MAX_MODEL_LEN, raising=False)


@pytest.mark.parametrize("requested,expected", [(None, 8192), (8192, 8192), (100, 100)])
def test_within_the_context(requested, expected):
    assert model_len_of(_config(requested), SMOLLM2) == expected


def test_past_the_context_is_refused():
    with pytest.raises(ValueError) as caught:
        model_len_of(_config(100_000), SMOLLM2)
    assert type(caught.value) is ValueError
    message = str(caught.value)
    assert message.startswith("max_model_len: 100000 tokens is longer than the model's context")
    assert "context length of 8192 tokens (max_position_embeddings)" in message
    assert f"{LONG_MAX_MODEL_LEN}=1" in message


def test_a_config_without_a_context_assumes_2048():
    config = types.SimpleNamespace()
    assert model_len_of(_config(None), config) == 2048
    with pytest.raises(ValueError, match=r"^max_model_len: 4096 .* of 2048 tokens \(the config"):
        model_len_of(_config(4096), config)


@pytest.mark.parametrize("value", ["1", "true", " ON "])
def test_the_environment_variable_allows_it_with_a_warning(monkeypatch, caplog, value):
    monkeypatch.setenv(LONG_MAX_MODEL_LEN, value)
    with caplog.at_level(logging.WARNING, logger="sparsekv.engine.model_len"):
        assert model_len_of(_config(100_000), SMOLLM2) == 100_000
    assert "max_model_len 100000 is longer than the model's context length of 8192" in caplog.text


def test_an_off_value_still_refuses(monkeypatch):
    monkeypatch.setenv(LONG_MAX_MODEL_LEN, "0")
    with pytest.raises(ValueError, match="^max_model_len: 100000"):
        model_len_of(_config(100_000), SMOLLM2)


def test_the_engine_refuses_it_at_build(smollm2_tokenizer):
    checkpoint, _ = tiny_checkpoint(tiny_llama_config(num_layers=1), smollm2_tokenizer)
    config = EngineConfig(
        model=ModelConfig(dtype="float32", device="cpu", max_model_len=4097),
        cache=CacheConfig(kv_cache_memory=0.01),
    )
    with pytest.raises(ValueError, match="^max_model_len: 4097 tokens .* of 4096 tokens"):
        build_engine_parts(config, checkpoint)


@pytest.mark.parametrize(
    "rope,context,source",
    [
        # Qwen2.5's documented long-context setting: yarn x4 over 32768 positions.
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            131072,
            "original_max_position_embeddings 32768 x yarn factor 4.0",
        ),
        ({"type": "yarn", "factor": 2.0}, 16384, "max_position_embeddings 8192 x yarn factor 2.0"),
        ({"rope_type": "linear", "factor": 2.0}, 16384, "x linear factor 2.0"),
        ({"rope_type": "dynamic", "factor": 1.5}, 12288, "x dynamic factor 1.5"),
        # Already the extended length in max_position_embeddings:
        ({"rope_type": "llama3", "factor": 8.0}, 8192, "max_position_embeddings"),
        ({"rope_type": "longrope", "factor": 4.0}, 8192, "max_position_embeddings"),
        ({"rope_type": "default", "rope_theta": 10000.0}, 8192, "max_position_embeddings"),
        ({"rope_type": "linear", "factor": 1.0}, 8192, "max_position_embeddings"),
        # The stretched length stated already (original 2048 x 4 = max_position_embeddings), or
        # an original x factor below it: max_position_embeddings stays the context.
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
            8192,
            "max_position_embeddings",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
            8192,
            "max_position_embeddings",
        ),
        # One setting per layer type (Gemma 3): its max_position_embeddings is the context.
        (
            {"full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {}},
            8192,
            "max_position_embeddings",
        ),
    ],
)
def test_rope_scaling_stretches_the_context(rope, context, source):
    for key in ("rope_parameters", "rope_scaling"):
        config = types.SimpleNamespace(max_position_embeddings=8192, **{key: rope})
        length, where = model_context(config)
        assert length == context and source in where
        assert model_len_of(_config(None), config) == context
        assert model_len_of(_config(context), config) == context
        with pytest.raises(ValueError, match=f"of {context} tokens"):
            model_len_of(_config(context + 1), config)
