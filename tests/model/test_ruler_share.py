"""One prefill per RULER sample: every cell attaches the full cache's prompt pages (prefix
cache) and recomputes only its tail, with the answers and kept slots of a cold run.

The model is a tiny random Gemma 3 (sliding-window and global layers, as Gemma 3 270M) with
SmolLM2's tokenizer (KVzip frames its reconstruction with the chat template)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sparsekv.config import (
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from sparsekv.engine.engine_setup import build_engine_parts
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.evaluation import ruler_cells, ruler_main, ruler_run, ruler_share, ruler_tasks
from tests.model.test_gemma3 import checkpoint_of, random_hf_model, tiny_config

BLOCK, WINDOW, SLIDE, MAX_TOKENS = 4, 8, 16, 6
METHODS = ["none", "snapkv", "pyramidkv", "expected_attention", "kvzip", "h2o",
           "snapkv:kernel_size=3"]  # fmt: skip
PROTOCOLS = ["aware", "agnostic"]


@pytest.fixture(scope="module")
def checkpoint(smollm2_tokenizer):
    config = tiny_config(vocab_size=len(smollm2_tokenizer), sliding_window=SLIDE)
    checkpoint = checkpoint_of(random_hf_model(config, seed=5))
    checkpoint.tokenizer = smollm2_tokenizer
    return checkpoint


def make_cases(lengths=(93, 110, 77), question=9):
    cases = []
    for index, n in enumerate(lengths):
        ids = torch.randint(10, 49000, (n,), generator=torch.Generator().manual_seed(index))
        sample = ruler_tasks.RulerSample("niah_single_1", index, "c", "q", "a", ["w"], n)
        cases.append(ruler_run.RulerCase(sample, "all", 128, ids.tolist(), n - question,
                                         MAX_TOKENS))  # fmt: skip
    return cases


def base_config(prefix_caching: bool) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(
            kv_cache_memory=0.02, block_size=BLOCK, enable_prefix_caching=prefix_caching
        ),
        compression=CompressionConfig(
            method="snapkv", budget=None, window=WINDOW, full_layers=0, kernel_size=5
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, watermark_pages=0),
    )


def run_grid(checkpoint, share_group: int):
    cases = make_cases()
    config = base_config(prefix_caching=bool(share_group))
    cells = ruler_cells.grid_cells(METHODS, [0.5], config.compression)
    if share_group:
        config = ruler_share.sharing_config(config, 110, MAX_TOKENS, share_group, 14)
    engine = LLMEngine(config, build_engine_parts(config, checkpoint))
    before = dataclasses.replace(engine.stats)
    rows = ruler_run.run(engine, cases, cells, PROTOCOLS, share_group=share_group)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    return cases, rows, ruler_main.prefill_counts(engine.stats, before, cases), engine


def expected_hit(case, method: str, protocol: str) -> int:
    """Tokens a follower attaches: its prompt (or context) short of the observation window,
    whole pages; H2O none (it scores with every query's attention)."""
    if method == "h2o":
        return 0
    end = case.context_tokens if protocol == "agnostic" else len(case.prompt_ids)
    return (end - WINDOW) // BLOCK * BLOCK


@pytest.mark.slow
def test_shared_prefill_gives_the_answers_of_a_cold_run_with_one_prefill(checkpoint):
    cases, cold, cold_counts, _ = run_grid(checkpoint, share_group=0)
    _, shared, counts, engine = run_grid(checkpoint, share_group=2)
    assert len(shared) == len(cold) == len(cases) * (1 + 2 * (len(METHODS) - 1)) + len(cases)
    keys = ("task", "sample", "protocol", "method", "ratio", "prediction", "compression_ratio")
    assert [tuple(r[k] for k in keys) for r in shared] == [tuple(r[k] for k in keys) for r in cold]
    # Compression happened: the compressed cells hold fewer slots than the full cache.
    assert {r["compression_ratio"] > 0 for r in shared if r["method"] != "none"} == {True}
    assert cold_counts["prefix_hit_tokens"] == 0
    hits = sum(
        expected_hit(case, method, protocol)
        for case in cases
        for method in METHODS[1:]
        for protocol in PROTOCOLS
    )
    assert counts["prefix_hit_tokens"] == hits
    followers = len(cases) * (len(METHODS) - 2) * len(PROTOCOLS)  # all but none and h2o
    assert engine.stats.num_prefix_cache_hits == followers
    # One prefill per sample, plus each follower's window (and question), plus H2O's prompts.
    prompts = sum(len(case.prompt_ids) for case in cases)
    tails = sum(
        len(case.prompt_ids) - expected_hit(case, m, p)
        for case in cases
        for m in METHODS[1:]
        for p in PROTOCOLS
    )
    assert counts["computed_prompt_tokens"] == prompts + tails
    assert cold_counts["computed_prompt_tokens"] == prompts * (1 + 2 * (len(METHODS) - 1))


def test_stages_run_a_group_sharers_before_its_followers():
    sharers = ["s0", "s1", "s2"]
    followers = [["f0a", "f0b"], ["f1a"], ["f2a"]]
    assert ruler_share.stages(sharers, followers, 2) == [
        ["s0", "s1"],
        ["s2", "f0a", "f0b", "f1a"],
        ["f2a"],
    ]
    assert ruler_share.stages(sharers, followers, 3) == [sharers, ["f0a", "f0b", "f1a", "f2a"]]
    with pytest.raises(ValueError, match="group"):
        ruler_share.stages(sharers, followers, 0)
    with pytest.raises(ValueError, match="followers"):
        ruler_share.stages(sharers, followers[:2], 1)


def test_sharing_config_fits_a_group_in_one_step():
    config = ruler_share.sharing_config(base_config(False), 4000, 128, 2, 54)
    assert config.cache.enable_prefix_caching
    assert config.model.max_model_len == 4128
    assert config.scheduler.max_num_batched_tokens == 2 * 4000 + 8192
    assert config.scheduler.max_num_seqs == 64  # the default already holds 2 + 54


def test_cells_from_method_specs(tmp_path):
    budgets = {"format": "sparsekv-layer-budgets", "version": 1, "kind": "fractions",
               "num_layers": 3, "budgets": [1.0, 0.25, 0.5]}  # fmt: skip
    (tmp_path / "cal_0.75.json").write_text(json.dumps(budgets))
    specs = [
        "none",
        "snapkv",
        "snapkv:kernel_size=7",
        f"snapkv:budgets={tmp_path}/cal_{{ratio}}.json",
    ]
    cells = ruler_cells.grid_cells(specs, [0.75], CompressionConfig(budget=None))
    assert [(c.method, c.ratio) for c in cells] == [
        ("none", 0.0), ("snapkv", 0.75), (specs[2], 0.75), (specs[3], 0.75)
    ]  # fmt: skip
    assert [c.policy.kernel_size for c in cells[1:]] == [15, 7, 15]
    assert cells[3].policy.layer_fractions == (1.0, 0.25, 0.5)
    assert cells[3].policy.method == "snapkv" and cells[3].policy.compression_ratio == 0.75
    with pytest.raises(ValueError, match="key=value"):
        ruler_cells.grid_cells(["snapkv:15"], [0.5], CompressionConfig(budget=None))
    with pytest.raises(ValueError, match="not a setting"):
        ruler_cells.grid_cells(["snapkv:budget=3"], [0.5], CompressionConfig(budget=None))
    [off] = ruler_cells.grid_cells(["snapkv:decode_eviction=off"], [0.5], CompressionConfig())
    assert off.policy.decode_eviction is False  # not bool("off")
    with pytest.raises(ValueError, match="decode_eviction is on or off, got 'maybe'"):
        ruler_cells.grid_cells(["snapkv:decode_eviction=maybe"], [0.5], CompressionConfig())
