"""``--device``, ``--attention-backend``, ``--gpu-memory-utilization``, ``--enforce-eager`` and
the KV pool size when ``--kv-cache-memory`` is unset (no model is loaded here)."""

from __future__ import annotations

import argparse

import pytest
import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sparsekv.engine import engine_setup, pool_sizing
from sparsekv.engine.device_memory import GIB, ProfilingContext, kv_cache_gib


def _config(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(flags)))


def test_defaults():
    config = _config()
    assert config.model.device == "auto"
    assert config.model.attention_backend == "auto"
    assert config.model.enforce_eager is False
    assert config.cache.gpu_memory_utilization == 0.9
    assert config.cache.kv_cache_memory is None


def test_flags_reach_the_config():
    config = _config(
        "--device", "cpu", "--attention-backend", "torch", "--gpu-memory-utilization", "0.5",
        "--enforce-eager", "--kv-cache-memory", "1.5",
    )  # fmt: skip
    assert config.model.device == "cpu" and config.model.attention_backend == "torch"
    assert config.model.enforce_eager is True
    assert config.cache.gpu_memory_utilization == 0.5 and config.cache.kv_cache_memory == 1.5


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_gpu_memory_utilization_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        _config("--gpu-memory-utilization", value)


def test_unknown_backend_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        _config("--attention-backend", "cuda_magic")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ModelConfig(device="tpu"), "device must be one of auto, cpu, cuda"),
        (ModelConfig(attention_backend="flash"), "attention_backend must be one of"),
        (CacheConfig(kv_cache_memory=0), "kv_cache_memory must be a finite number > 0"),
        (CacheConfig(kv_cache_memory=float("inf")), "kv_cache_memory must be a finite number"),
        (CacheConfig(kv_cache_memory=float("nan")), "kv_cache_memory must be a finite number"),
        (SchedulerConfig(watermark_pages=-1), "watermark_pages must be >= 0, got -1"),
    ],
)
def test_bad_values_name_their_parameter(config, message):
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_cuda_with_an_index_is_a_valid_device():
    ModelConfig(device="cuda:1").validate()


def test_device_auto_is_cpu_without_cuda_and_cuda_needs_a_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_setup.resolve_device("auto") == "cpu"
    assert engine_setup.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device: 'cuda' but no CUDA device"):
        engine_setup.resolve_device("cuda")


def test_given_kv_cache_memory_wins_on_every_device():
    config = EngineConfig(cache=CacheConfig(kv_cache_memory=3.5))
    assert kv_cache_gib(config, "cpu") == 3.5
    calls = []
    assert kv_cache_gib(config, "cuda", profile=lambda: calls.append(1)) == 3.5
    assert calls == []  # no profiling forward when the size is given


def test_cpu_default_is_two_gib_and_keeps_the_free_ram_check(monkeypatch):
    config = EngineConfig()
    assert kv_cache_gib(config, "cpu") == 2.0
    geometry = (4, 3, 64, torch.float32)
    unset = pool_sizing.num_pool_pages(config, *geometry)
    given = pool_sizing.num_pool_pages(EngineConfig(cache=CacheConfig(kv_cache_memory=2.0)), *geometry)  # fmt: skip
    assert unset == given > 0
    monkeypatch.setattr(pool_sizing, "available_memory_bytes", lambda: 2 * GIB)
    with pytest.raises(ValueError, match="kv_cache_memory: 2 GiB exceeds 80%"):
        pool_sizing.num_pool_pages(config, *geometry)


def test_cuda_pool_is_utilization_minus_used_minus_peak_activations():
    config = EngineConfig(cache=CacheConfig(gpu_memory_utilization=0.9))
    calls = []
    gib = kv_cache_gib(
        config,
        "cuda",
        profile=lambda: calls.append("forward"),
        mem_info=lambda: (60 * GIB, 80 * GIB),  # 20 GiB in use after the forward
        peak_activation_bytes=lambda: 4 * GIB,
    )
    assert calls == ["forward"]
    assert gib == pytest.approx(80 * 0.9 - 20 - 4)


def test_cuda_utilization_too_low_is_refused():
    config = EngineConfig(cache=CacheConfig(gpu_memory_utilization=0.2))
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.2 of 80.0 GiB leaves no"):
        kv_cache_gib(
            config, "cuda", mem_info=lambda: (60 * GIB, 80 * GIB), peak_activation_bytes=lambda: 0
        )


def test_profiling_context_is_causal_attention_over_the_step():
    ctx = ProfilingContext(TorchBackend())
    q, k, v = torch.randn(12, 6, 32), torch.randn(12, 2, 32), torch.randn(12, 2, 32)
    out = ctx.attend(0, q, k, v, 0.2, sliding_window=5)
    want, _ = torch_ref.attention_with_lse(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), 0.2, 5
    )
    torch.testing.assert_close(out, want.transpose(0, 1))
