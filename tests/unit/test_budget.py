"""Per-layer budgets and peak slots (docs/design.md, "Budgets and ratios"; PyramidKV's
schedule, arXiv 2406.02069)."""

from __future__ import annotations

import pytest

from sparsekv.config import CompressionConfig
from sparsekv.kv_cache.budget import (
    layer_budgets,
    num_pages,
    peak_layer_slots,
    peak_sliding_slots,
    pyramid_budgets,
    ratio_budget,
)


def test_pyramid_worked_example():
    budgets = pyramid_budgets(512, 8, 7500, 32)
    assert len(budgets) == 32
    assert (budgets[0], budgets[15], budgets[31]) == (991, 541, 61)
    assert all(a - b == 30 for a, b in zip(budgets, budgets[1:]))  # steps = 30


def test_pyramid_caps_the_top_at_the_prompt():
    # min 22, max 874 >= n - W = 836 -> max 836, min 60, steps 776 // 31 = 25
    budgets = pyramid_budgets(512, 64, 900, 32)
    assert (budgets[0], budgets[1], budgets[31]) == (900, 875, 125)


@pytest.mark.parametrize("n", [100, 511, 900, 1007])
def test_pyramid_fallbacks_are_uniform(n):
    # n < B keeps everything; n < 2 * (B - W) = 1008 is uniform SnapKV: both a flat B.
    assert pyramid_budgets(512, 8, n, 32) == [512] * 32


def test_pyramid_edge_cases():
    assert pyramid_budgets(512, 8, 7500, 1) == [512]
    assert pyramid_budgets(512, 8, 7500, 0) == []
    assert min(pyramid_budgets(20, 8, 7500, 32)) >= 9  # never below window + 1


@pytest.mark.parametrize(
    "ratio,n,expected", [(0.75, 1000, 250), (0.7, 1000, 300), (0.5, 7, 33), (0.1, 999, 900)]
)
def test_ratio_budget(ratio, n, expected):
    assert ratio_budget(ratio, 32, n) == expected


def test_full_layers_then_budget():
    config = CompressionConfig(budget=256, full_layers=2)
    assert layer_budgets(config, 5, 4000, [True] * 5) == [None, None, 256, 256, 256]


def test_ratio_applies_to_budgeted_layers():
    config = CompressionConfig(budget=None, compression_ratio=0.75, full_layers=1, window=32)
    assert layer_budgets(config, 3, 1000, [True] * 3) == [None, 250, 250]


def test_sliding_layers_are_never_budgeted():
    config = CompressionConfig(budget=128, full_layers=1)
    compressible = [True, False, True, False, True, True]
    assert layer_budgets(config, 6, 4000, compressible) == [None, None, 128, None, 128, 128]


def test_explicit_list_overrides():
    config = CompressionConfig(budget=128, full_layers=3, layer_budgets=(0, 64, 100, 0, 200))
    compressible = [True, True, True, True, False]
    assert layer_budgets(config, 5, 4000, compressible) == [None, 64, 100, None, None]
    with pytest.raises(ValueError, match="layer_budgets"):
        layer_budgets(config, 4, 4000, [True] * 4)


@pytest.mark.parametrize(
    "config",
    [
        CompressionConfig(method="none"),
        CompressionConfig(budget=None, compression_ratio=0.0),
        CompressionConfig(method="none", layer_budgets=(64, 64)),
    ],
)
def test_policy_off_keeps_everything(config):
    assert layer_budgets(config, 2, 4000, [True, True]) == [None, None]


def test_pyramid_schedule_over_budgeted_layers_only():
    config = CompressionConfig(method="pyramidkv", budget=512, window=8, full_layers=2)
    compressible = [True] * 18 + [False] + [True] * 16  # 35 layers, 32 budgeted
    budgets = layer_budgets(config, 35, 7500, compressible)
    assert budgets[:2] == [None, None] and budgets[18] is None
    scheduled = [b for b in budgets if b is not None]
    assert scheduled == pyramid_budgets(512, 8, 7500, 32)
    assert (budgets[2], budgets[2 + 15], budgets[34]) == (991, 541, 61)


def test_pyramid_with_ratio_uses_derived_average():
    config = CompressionConfig(
        method="pyramidkv", budget=None, compression_ratio=0.9, window=8, full_layers=0
    )
    assert layer_budgets(config, 4, 10000, [True] * 4) == pyramid_budgets(1000, 8, 10000, 4)


def test_missing_size_is_rejected():
    config = CompressionConfig(budget=None)
    with pytest.raises(ValueError, match="budget"):
        layer_budgets(config, 2, 100, [True, True])


@pytest.mark.parametrize(
    "budget,eviction,expected",
    [
        (None, True, 1100),  # full: n + max_tokens
        (256, True, 256 + 16),  # grows to budget + block_size
        (256, False, 256 + 100),
        (2000, True, 1100),  # never reaches the budget
        (2000, False, 1100),
    ],
)
def test_peak_layer_slots(budget, eviction, expected):
    assert peak_layer_slots(budget, 1000, 100, 16, eviction) == expected


def test_peak_layer_slots_short_prompt_with_eviction():
    # prompt 100 < budget 256: peak = min(100 + 500, max(100, 256 + 16)) = 272
    assert peak_layer_slots(256, 100, 500, 16, True) == 272
    assert peak_layer_slots(256, 100, 10, 16, True) == 110


def test_sliding_and_pages():
    assert peak_sliding_slots(512, 4096, 16) == 4624
    assert [num_pages(s, 16) for s in (0, 1, 16, 17)] == [0, 1, 1, 2]
