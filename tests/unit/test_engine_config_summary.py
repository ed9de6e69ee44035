"""The startup line summing up the engine's effective configuration (``format_engine_summary``),
exactly as logged, for a default, a quantized and a compression-off configuration."""

from __future__ import annotations

import torch

from sparsekv.compression_config import CompressionConfig
from sparsekv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from sparsekv.engine.config_summary import compression_summary, format_engine_summary

GIB = 1 << 30


def test_default_config_shows_what_auto_resolved_to():
    line = format_engine_summary(
        EngineConfig(), "smollm2-135m-instruct", torch.float32, [5461], GIB // 4, [], True, 2
    )
    assert line == (
        "engine config: model smollm2-135m-instruct, dtype float32, weights float32, "
        "kv cache float32, kv pool 5461 pages (0.25 GiB, block size 16), "
        "compression snapkv (budget 1024, window 32), prefix caching on, max_num_seqs 64, "
        "max_num_batched_tokens 4096, torch threads 2"
    )


def test_quantized_cache_with_full_precision_layers_shows_both_pools():
    config = EngineConfig(
        model=ModelConfig(weight_dtype="int8"),
        cache=CacheConfig(
            kv_cache_dtype="int8", kv_cache_full_precision_layers=(0, 29), block_size=32
        ),
        compression=CompressionConfig(
            method="pyramidkv", budget=None, compression_ratio=0.5, window=16, scope="context"
        ),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048),
    )
    line = format_engine_summary(config, "m", torch.bfloat16, [14000, 1000], 3 * GIB // 2,
                                 [0, 29], False, 16)  # fmt: skip
    assert line == (
        "engine config: model m, dtype bfloat16, weights int8, "
        "kv cache int8 (full-precision layers 0,29), "
        "kv pool 14000 int8 + 1000 bfloat16 pages (1.50 GiB, block size 32), "
        "compression pyramidkv (ratio 0.5, window 16, scope context), prefix caching off, "
        "max_num_seqs 8, max_num_batched_tokens 2048, torch threads 16"
    )


def test_compression_off_and_explicit_dtypes():
    config = EngineConfig(
        model=ModelConfig(dtype="bfloat16", weight_dtype="gguf"),
        cache=CacheConfig(kv_cache_dtype="fp8"),
        compression=CompressionConfig(method="none"),
    )
    line = format_engine_summary(config, "q", torch.bfloat16, [100], 200 * 2**20, [], True, 1)
    assert line == (
        "engine config: model q, dtype bfloat16, weights gguf, kv cache fp8, "
        "kv pool 100 pages (0.20 GiB, block size 16), compression none, prefix caching on, "
        "max_num_seqs 64, max_num_batched_tokens 4096, torch threads 1"
    )


def test_compression_summary_budget_forms():
    assert compression_summary(CompressionConfig(compression_ratio=0, budget=None)) == "none"
    per_layer = CompressionConfig(method="snapkv", layer_budgets=(0, 64), window=8)
    assert compression_summary(per_layer) == "snapkv (layer budgets, window 8)"
    fractions = CompressionConfig(method="h2o", layer_fractions=(1.0, 0.5))
    assert compression_summary(fractions) == "h2o (layer fractions, window 32)"
