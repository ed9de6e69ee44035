"""Adaptive head budgets: the Ada-KV split against brute force, head-wise page bookkeeping,
and the settings that reject what head-wise pages do not support."""

from __future__ import annotations

import argparse

import pytest
import torch

from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.compression.head_budgets import adaptive_head_kept
from sparsekv.config import CacheConfig, CompressionConfig, EngineConfig, SpeculativeConfig
from sparsekv.kv_cache import head_pages
from sparsekv.kv_cache.budget import peak_request_pages
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.spec import LayerSpec, cdiv


def brute_force(scores, budget, num_recent, safeguard=0.2):
    """Ada-KV by Python sorts: per head the recent slots and the best ``safe - recent`` older
    ones, then the best of the rest over all heads (score, newer slot, lower head)."""
    num_heads, n = scores.shape
    if n <= budget:
        return [list(range(n)) for _ in range(num_heads)]
    older = n - num_recent
    safe = min(max(int(safeguard * budget) - num_recent, 0), budget - num_recent)
    chosen = []
    for h in range(num_heads):
        order = sorted(range(older), key=lambda j: (-float(scores[h, j]), -j))
        chosen.append(set(order[:safe]))
    rest = [(h, j) for h in range(num_heads) for j in range(older) if j not in chosen[h]]
    rest.sort(key=lambda item: (-float(scores[item[0], item[1]]), -item[1], item[0]))
    for h, j in rest[: num_heads * (budget - num_recent - safe)]:
        chosen[h].add(j)
    return [sorted(c) + list(range(older, n)) for c in chosen]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_heads, n, budget, recent", [(3, 40, 12, 4), (2, 17, 9, 1),
                                                          (4, 64, 20, 8), (1, 30, 10, 3)])  # fmt: skip
def test_split_equals_brute_force_with_ties(seed, num_heads, n, budget, recent):
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values: ties within a head and across heads are everywhere.
    scores = torch.randint(0, 5, (num_heads, n), generator=generator).float()
    kept = adaptive_head_kept(scores, budget, recent)
    assert [k.tolist() for k in kept] == brute_force(scores, budget, recent)
    assert sum(len(k) for k in kept) == num_heads * budget


@pytest.mark.parametrize("safeguard", [0.0, 0.2, 0.5, 1.0])
def test_safeguard_floor_and_layer_sum(safeguard):
    generator = torch.Generator().manual_seed(3)
    scores = torch.rand(4, 100, generator=generator)
    scores[0] *= 10  # one head dominates: the others keep only their floor
    budget, recent = 20, 2
    kept = adaptive_head_kept(scores, budget, recent, safeguard)
    floor = max(int(safeguard * budget), recent)
    assert sum(len(k) for k in kept) == 4 * budget
    assert all(len(k) >= floor for k in kept)
    assert [len(k) for k in kept[1:]] == [floor] * 3
    for k in kept:
        assert k.tolist() == sorted(k.tolist())
        assert k[-recent:].tolist() == [98, 99]
    assert [k.tolist() for k in kept] == brute_force(scores, budget, recent, safeguard)


def test_short_layer_keeps_everything_and_bad_arguments_raise():
    kept = adaptive_head_kept(torch.rand(3, 8), budget=8, num_recent=2)
    assert [k.tolist() for k in kept] == [list(range(8))] * 3
    with pytest.raises(ValueError, match="safeguard"):
        adaptive_head_kept(torch.rand(2, 20), 8, 2, safeguard=1.5)
    with pytest.raises(ValueError, match="num_recent"):
        adaptive_head_kept(torch.rand(2, 20), 8, 9)


def test_head_tables_growth_and_insertion():
    state = LayerKV(block_table=[10, 11, 20, 30, 31, 32], head_lens=[20, 5, 33],
                    head_pages=[2, 1, 3])  # fmt: skip
    assert head_pages.head_tables(state.block_table, state.head_pages) == [
        [10, 11], [20], [30, 31, 32]
    ]  # fmt: skip
    # 12 slots per page: head 0 has 4 free slots, head 1 7, head 2 3.
    assert head_pages.growth(state, 1, 12) == (0, 0, 0)
    assert head_pages.growth(state, 5, 12) == (1, 0, 1)
    fresh = iter([[40], [41]])
    head_pages.grow(state, (1, 0, 1), lambda count: next(fresh))
    assert state.block_table == [10, 11, 40, 20, 30, 31, 32, 41]
    assert state.head_pages == [3, 1, 4]
    assert head_pages.split_pages([0, 12, 13], 12) == [0, 1, 2]
    assert head_pages.mean_held([20, 5, 33]) == 20


def test_peak_pages_add_one_page_per_head_on_budgeted_layers():
    specs = [LayerSpec() for _ in range(3)]
    budgets = [None, 64, 64]
    args = ([s for s in specs], budgets, 500, 10, 16, 4096)
    flat = peak_request_pages(*args, decode_eviction=False, bounded_chunks=False)
    heads = peak_request_pages(*args, decode_eviction=False, bounded_chunks=False, head_slack=3)
    assert heads == flat + 2 * 3
    # Decode eviction stays on the layers the prompt fits; split layers grow without it.
    mixed = ([s for s in specs], [None, 64, 600], 500, 10, 16, 4096)
    heads = peak_request_pages(*mixed, decode_eviction=True, bounded_chunks=False, head_slack=3)
    assert heads == cdiv(510, 16) + (cdiv(74, 16) + 3) + cdiv(510, 16)


def test_head_budgets_setting_is_validated():
    with pytest.raises(ValueError, match="kv_compression.head_budgets must be flat or adaptive"):
        CompressionConfig(head_budgets="ada").validate()
    with pytest.raises(ValueError, match="kv_compression.head_budgets: adaptive.*bounded"):
        CompressionConfig(head_budgets="adaptive", chunked_mode="bounded").validate()
    adaptive = CompressionConfig(head_budgets="adaptive")
    with pytest.raises(ValueError, match="head_budgets.*kv_cache_dtype"):
        EngineConfig(compression=adaptive, cache=CacheConfig(kv_cache_dtype="int8")).validate()
    with pytest.raises(ValueError, match="head_budgets.*speculative_method"):
        EngineConfig(compression=adaptive, speculative=SpeculativeConfig(method="ngram")).validate()
    # Off policies never conflict.
    off = CompressionConfig(method="none", head_budgets="adaptive")
    EngineConfig(compression=off, cache=CacheConfig(kv_cache_dtype="int8")).validate()


def test_cli_flag_sets_head_budgets():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-head-budgets", "adaptive"])
    assert engine_config_from_args(args).compression.head_budgets == "adaptive"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-head-budgets", "ada"])


def test_bench_fidelity_grid_takes_head_budgets_per_method():
    from sparsekv.bench import fidelity

    args = argparse.Namespace(quick=False, methods="snapkv,snapkv:head_budgets=adaptive",
                              ratios="0.75")  # fmt: skip
    cells = fidelity.grid(args, CompressionConfig())
    assert [(m, r, p.head_budgets) for m, r, p in cells] == [
        ("snapkv", 0.75, "flat"),
        ("snapkv:head_budgets=adaptive", 0.75, "adaptive"),
    ]
    with pytest.raises(ValueError, match="head_budgets must be flat or adaptive"):
        fidelity.grid(argparse.Namespace(quick=False, methods="snapkv:head_budgets=x",
                                         ratios="0.75"), CompressionConfig())  # fmt: skip


def test_plans_go_head_wise_only_with_several_kv_heads():
    from sparsekv.kv_cache.plan import KVPolicy, plan_layers

    def plan(num_kv_heads):
        layers = [LayerKV(budget=40)]
        policy = KVPolicy(decode_eviction=False, head_wise=True)
        return plan_layers(layers, policy, 100, True, True, 16, lambda t: False, num_kv_heads)[0]

    three = plan(3)
    assert (three.to_heads, three.compact_slack, three.compress_to) == (True, 2, 40)
    assert three.capacity == 40 + 2 * 16
    one = plan(1)  # one KV head (Gemma 3 270M): nothing to share, the flat layout
    assert (one.to_heads, one.compact_slack, one.capacity) == (False, 0, 40)
    grown = LayerKV(budget=40, head_lens=[47, 30, 43], head_pages=[1, 1, 1])
    policy = KVPolicy(decode_eviction=False, head_wise=True)
    steps = plan_layers([grown], policy, 1, False, False, 16, lambda t: False, 3)
    assert steps[0].head_growth == (0, 0, 0)
    steps = plan_layers([grown], policy, 2, False, False, 16, lambda t: False, 3)
    assert steps[0].head_growth == (1, 0, 0)
