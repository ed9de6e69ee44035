"""Engines and prompts for the speculative decoding tests (tiny random models, vocabulary 512)."""

from __future__ import annotations

import torch

from sparsekv.config import (
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from sparsekv.engine.engine_setup import build_engine_parts
from sparsekv.engine.llm_engine import LLMEngine
from tests.model.family_models import VOCAB, checkpoint_of, random_hf_model, tiny_config

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_prompt_lookup_max=3)


# Weight scales whose greedy outputs are neither constant (every draft accepted) nor so noisy
# that no draft is: both accepted and rejected drafts occur on the test prompts.
INIT_RANGES = {"qwen2": 0.2, "gemma2": 0.02}


def tiny_checkpoint(family: str, seed: int = 1):
    """A loader-like checkpoint of a random tiny model of ``family`` (``family_models``)."""
    config = tiny_config(family)
    config.initializer_range = INIT_RANGES.get(family, config.initializer_range)
    return checkpoint_of(random_hf_model(config, seed), config)


def engine(
    checkpoint,
    speculative: SpeculativeConfig | None = None,
    compression: CompressionConfig | None = None,
    num_pages: int | None = None,
    block_size: int = 4,
    prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    **sched,
) -> LLMEngine:
    """An fp32 engine; ``sched`` sets ``SchedulerConfig`` fields."""
    sched.setdefault("watermark_pages", 0)
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(
            kv_cache_memory=0.01,
            num_pages=num_pages,
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
        ),
        compression=compression or CompressionConfig(method="none"),
        scheduler=SchedulerConfig(**sched),
        speculative=speculative or SpeculativeConfig(),
    )
    return LLMEngine(config, build_engine_parts(config, checkpoint))


def repetitive_prompts(lengths: list[int], seed: int = 0, period: int = 7) -> list[list[int]]:
    """Prompts made of a repeated random segment of ``period`` tokens (lookups hit)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        segment = torch.randint(4, VOCAB, (period,), generator=generator).tolist()
        prompts.append((segment * (n // period + 1))[:n])
    return prompts


def generate(engine: LLMEngine, prompts, params_list) -> dict:
    """Run the prompts together; request id ``r{i}`` -> final ``RequestOutput``."""
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    engine.kv.check_invariants()
    return done


def token_ids(done: dict) -> list[list[int]]:
    return [done[f"r{i}"].outputs[0].token_ids for i in range(len(done))]
