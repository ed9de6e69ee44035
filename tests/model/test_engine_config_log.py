"""Building an engine on the built-in model logs one line of its effective configuration."""

from __future__ import annotations

import logging

import torch

from sparsekv.config import CompressionConfig


def test_engine_start_logs_its_effective_configuration(make_engine, smollm2_checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="sparsekv.engine.llm_engine")
    policy = CompressionConfig(method="snapkv", budget=64, window=8)
    engine = make_engine(smollm2_checkpoint, compression=policy, max_num_seqs=4)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine config:")]
    # 0.05 GiB of fp32 pages of 16 slots x 3 KV heads x 64 dims, K and V: 24 KiB each.
    assert engine.kv.pool.kind_sizes == [int(0.05 * 2**30) // (2 * 16 * 3 * 64 * 4)] == [2184]
    assert lines == [
        "engine config: model smollm2-135m-instruct, dtype float32, weights float32, "
        "kv cache float32, kv pool 2184 pages (0.05 GiB, block size 16), "
        "compression snapkv (budget 64, window 8), prefix caching on, max_num_seqs 4, "
        f"max_num_batched_tokens 4096, torch threads {torch.get_num_threads()}"
    ]
