"""The compression policy resolver (``kv_cache.policy``): one value object per request, from the
engine's settings, the request's overrides and the model's layer specs; and no module past the
registry names a method."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from sparsekv.compression.h2o import H2OCompressor
from sparsekv.compression.kvzip import KVzipCompressor
from sparsekv.compression.pyramidkv import PyramidKVCompressor
from sparsekv.compression.random_method import RandomCompressor
from sparsekv.compression.registry import COMPRESSORS, compressor_class
from sparsekv.compression.snapkv import SnapKVCompressor
from sparsekv.config import CompressionConfig, EngineConfig
from sparsekv.kv_cache.manager import KVCacheManager
from sparsekv.kv_cache.plan import KVPolicy
from sparsekv.kv_cache.policy import CompressionPolicy, resolve_policy
from sparsekv.kv_cache.spec import LayerSpec
from sparsekv.parallel_config import ParallelConfig

BS = 16
FULL, SLIDING = LayerSpec(), LayerSpec(kind="sliding", sliding_window=32)


def manager(specs=(FULL,) * 4, num_pages: int = 400, **kw) -> KVCacheManager:
    return KVCacheManager(list(specs), num_pages, BS, 1, 2, torch.float32, **kw)


def engine_config(**compression) -> EngineConfig:
    return EngineConfig(compression=CompressionConfig(**compression))


def resolve(config, overrides=None, kv=None, n=200, max_tokens=10, **kw) -> CompressionPolicy:
    return resolve_policy(config, overrides, kv or manager(), n, max_tokens, **kw)


def test_flat_budget():
    policy = resolve(engine_config(budget=64, window=8, full_layers=1))
    assert policy.settings == CompressionConfig(budget=64, window=8, full_layers=1)
    assert policy.compressor == SnapKVCompressor(8, "max", 15, "mean")
    assert policy.layer_budgets == (None, 64, 64, 64)
    # Side state: 3 budgeted layers' window queries, 3 x 1 head x 8 x 2 x 4 B = 192 B, under
    # one 256-byte page.
    assert policy.kv == KVPolicy(decode_eviction=True, bounded_chunks=False, side_pages=1)
    # Full layer: ceil(210 / 16) = 14 pages; budgeted: min(210, max(64, 64 + 16)) = 80 -> 5.
    assert policy.peak_pages == (14 + 3 * 5 + 1,)
    assert (policy.enabled, policy.window, policy.context_len) == (True, 8, None)
    assert not policy.needs_attention_mass and not policy.evicts_randomly
    assert not policy.reconstructs and policy.compressor.window_scored


def test_pyramid_schedule_comes_from_the_compressor_class():
    policy = resolve(engine_config(method="pyramidkv", budget=64, window=8, full_layers=0), n=1000)
    assert isinstance(policy.compressor, PyramidKVCompressor)
    # min_num = 56 // 20 = 2, max_num = 110, steps = 36: 118, 82, 46, 10 (average 64).
    assert policy.layer_budgets == (118, 82, 46, 10)


def test_layer_budget_lists_and_fractions():
    fractions = resolve(engine_config(window=8, layer_fractions=(1.0, 0.5, 0.25, 0.01)), n=400)
    assert fractions.layer_budgets == (None, 200, 100, 9)
    listed = resolve(engine_config(window=8, layer_budgets=(0, 64, 0, 32)))
    assert listed.layer_budgets == (None, 64, None, 32)


def test_sliding_layers_keep_a_full_cache():
    kv = manager((FULL, SLIDING, FULL, SLIDING), max_num_batched_tokens=64)
    policy = resolve(engine_config(budget=64, window=8, full_layers=0), kv=kv)
    assert policy.layer_budgets == (64, None, 64, None)
    # Budgeted: the exact chunked prefill holds the whole 200-token prompt (13 pages); sliding:
    # min(210, 32 + 64 + 16) = 112 slots (7 pages); one side page (2 layers' window queries).
    assert policy.peak_pages == (2 * 13 + 2 * 7 + 1,)


def test_request_overrides_merge_field_by_field():
    config = engine_config(budget=64, window=8, full_layers=0)
    h2o = resolve(config, {"method": "h2o", "budget": 40})
    assert h2o.settings.method == "h2o" and h2o.settings.window == 8
    assert h2o.compressor == H2OCompressor(8) and h2o.needs_attention_mass
    assert h2o.layer_budgets == (40,) * 4
    # Side state: per layer 8 x 2 query values and a mass for each of the 210 slots it can
    # hold, 4 x 226 x 4 B = 3616 B -> 15 pages of 256 B (SnapKV keeps no mass: 1 page).
    assert h2o.kv.side_pages == 15
    ratio = resolve(config, {"compression_ratio": 0.5})
    assert (ratio.settings.budget, ratio.layer_budgets) == (None, (100,) * 4)
    whole = CompressionConfig(method="random", budget=32, window=4, full_layers=3)
    chosen = resolve(config, whole)
    assert chosen.settings is whole and chosen.layer_budgets == (None, None, None, 32)
    assert isinstance(chosen.compressor, RandomCompressor) and chosen.evicts_randomly


@pytest.mark.parametrize("overrides", [{"method": "none"}, {"compression_ratio": 0.0}])
def test_nothing_budgeted_is_a_full_cache_policy(overrides):
    policy = resolve(engine_config(budget=64, window=8, full_layers=0), overrides)
    assert policy == CompressionPolicy(layer_budgets=(None,) * 4, peak_pages=(4 * 14,))
    assert (policy.enabled, policy.settings, policy.compressor, policy.window) == (
        False,
        None,
        None,
        1,
    )
    assert policy.kv == KVPolicy(decode_eviction=True, bounded_chunks=False)


def test_a_request_keeping_every_layer_full_is_refused():
    config = engine_config(budget=64, window=8, full_layers=0)
    with pytest.raises(
        ValueError, match=r"kv_compression.full_layers \(4\) must be < the model's 4"
    ):
        resolve(config, {"full_layers": 4})
    kept = resolve(config, {"full_layers": 4, "layer_budgets": [0, 0, 0, 32]})
    assert kept.layer_budgets == (None, None, None, 32)


def test_bounded_chunks_and_no_decode_eviction():
    config = engine_config(budget=64, window=8, chunked_mode="bounded", decode_eviction=False)
    policy = resolve(config)
    assert policy.kv == KVPolicy(decode_eviction=False, bounded_chunks=True, side_pages=1)
    assert policy.bounded_chunks
    # Full layers 0-1: 14 pages each; budgeted: min(200, 64) + 10 = 74 slots -> 5 pages; one
    # side page.
    assert policy.peak_pages == (2 * 14 + 2 * 5 + 1,)


def test_context_scope_and_its_key():
    config = engine_config(budget=64, window=8, full_layers=0, scope="context")
    tokens = list(range(150))
    policy = resolve(config, {"context_tokens": 100}, n=150)
    assert policy.context_len == 100 and policy.layer_budgets == (64,) * 4
    assert policy.kv == KVPolicy(
        decode_eviction=False, bounded_chunks=False, context_only=True, side_pages=1
    )
    # Later tokens: 10 outputs + 50 question tokens; min(100, 64) + 60 = 124 slots -> 8 pages;
    # one side page.
    assert policy.peak_pages == (4 * 8 + 1,)
    key = policy.context_key(tokens)
    assert key.startswith(b"context:") and len(key) == 8 + 16
    same = resolve(config, {"context_tokens": 100}, n=150).context_key(tokens[:100] + [7] * 50)
    assert same == key  # the question is not part of the key
    assert resolve(config, {"context_tokens": 100, "budget": 32}).context_key(tokens) != key
    assert policy.context_key(tokens[:100]) is None  # the context is the whole prompt
    randomly = resolve(config, {"context_tokens": 100, "method": "random"}, n=150)
    assert randomly.context_key(tokens) is None
    assert resolve(engine_config()).context_key(tokens) is None  # scope prompt


def test_draft_tokens_count_in_the_peak():
    config = engine_config(budget=64, window=8, full_layers=0, decode_eviction=False)
    # Budgeted: min(200, 64) + later tokens: 74 slots -> 5 pages; 144 -> 9; 148 -> 10; plus
    # one side page.
    assert resolve(config).peak_pages == (4 * 5 + 1,)
    assert resolve(config, max_tokens=80).peak_pages == (4 * 9 + 1,)
    assert resolve(config, max_tokens=80, draft_tokens=4).peak_pages == (4 * 10 + 1,)


@pytest.mark.parametrize(
    ("overrides", "kw", "match"),
    [
        ({"budgett": 64}, {}, r"^kv_compression\.budgett: unknown field"),
        ({"budget": 4}, {}, r"^kv_compression\.budget \(4\) must be >= window \+ 1"),
        ({"budget": 64, "compression_ratio": 0.5}, {}, "kv_compression.budget and"),
        ({"scope": "context"}, {}, r"^kv_compression\.context_tokens: scope 'context'"),
        ({"scope": "context", "context_tokens": 300}, {}, "context_tokens: 300 exceeds"),
        ({"context_tokens": 100}, {}, r"^kv_compression\.context_tokens applies only to scope"),
        ({"layer_budgets": (0, 64)}, {}, r"^kv_compression\.layer_budgets: 2 budgets"),
        ({"layer_fractions": (0.5,)}, {}, r"^kv_compression\.layer_fractions: 1 fractions"),
        (CompressionConfig(method="snap"), {}, r"^kv_compression\.method: unknown method"),
        (None, {"max_tokens": 4000}, r"^max_tokens: the request needs \d+ KV pages"),
        ({"budget": 64.5}, {}, r"^kv_compression\.budget must be an integer, got 64\.5"),
        ({"budget": "64"}, {}, r"^kv_compression\.budget must be an integer"),
        ({"window": True}, {}, r"^kv_compression\.window must be an integer"),
        ({"compression_ratio": "0.5"}, {}, r"^kv_compression\.compression_ratio must be a number"),
        ({"decode_eviction": "no"}, {}, r"^kv_compression\.decode_eviction must be true or false"),
        ({"layer_budgets": (0, 64.0)}, {}, r"^kv_compression\.layer_budgets must be integers"),
        ({"layer_fractions": ("1",)}, {}, r"^kv_compression\.layer_fractions must be numbers"),
        ({"layer_budgets": 5}, {}, r"^kv_compression\.layer_budgets must be a list, got 5"),
        (
            {"kernel_size": 4},
            {},
            r"^kv_compression\.kernel_size must be an odd number in \[1, 1023\]",
        ),
        # one request's unbounded pooling width would hold the engine step for minutes
        ({"kernel_size": 2**31 - 1}, {}, r"^kv_compression\.kernel_size must be an odd number"),
        ({"kernel_size": 1025}, {}, r"got 1025$"),
    ],
)
def test_invalid_requests_name_the_parameter(overrides, kw, match):
    with pytest.raises(ValueError, match=match):
        resolve(engine_config(budget=64, window=8), overrides, **kw)


def test_a_budget_below_the_window_is_no_error_when_compression_is_off():
    # Method none keeps no budget: the request runs uncompressed instead of failing on a
    # budget it does not use.
    off = resolve(engine_config(budget=64, window=8), {"method": "none", "budget": 4})
    assert off.compressor is None
    CompressionConfig(method="none", layer_budgets=(0, 4)).validate()


def test_a_reconstructing_method_is_refused_under_tensor_parallelism():
    config = engine_config(method="kvzip", budget=64, window=8)
    assert isinstance(resolve(config).compressor, KVzipCompressor)
    assert resolve(config).reconstructs
    config.parallel = ParallelConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^kv_compression: kvzip is not supported with tensor"):
        resolve(config)
    assert not resolve(config, {"method": "none"}).enabled


def test_capabilities_are_class_attributes():
    flags = {
        name: (cls.needs_attention_mass, cls.evicts_randomly, cls.reconstructs)
        for name, cls in COMPRESSORS.items()
    }
    assert {name for name, f in flags.items() if f[0]} == {"h2o"}
    assert {name for name, f in flags.items() if f[1]} == {"random"}
    assert {name for name, f in flags.items() if f[2]} == {"kvzip"}
    assert compressor_class("h2o") is H2OCompressor
    with pytest.raises(ValueError, match=r"^kv_compression\.method: unknown method 'bogus'"):
        compressor_class("bogus")


# Past the registry, code reads capabilities, never a method's name.
_NAMES = "|".join(COMPRESSORS)
_NAME_CHECK = re.compile(
    rf"""(==|!=)\s*["']({_NAMES})["']|\.name\s*(==|!=)|["']({_NAMES})["']\s*(==|!=|in\b)"""
)
_NAMING_ALLOWED = (
    "compression/",
    "config.py",
    "compression_config.py",
    "cli_args.py",
    "bench/",
    "evaluation/",
)


def test_no_module_outside_compression_checks_a_method_name():
    root = Path(__file__).resolve().parents[2] / "sparsekv"
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(_NAMING_ALLOWED):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _NAME_CHECK.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
    assert _NAME_CHECK.search('if compressor.name == "h2o":')  # the pattern does catch one


def test_adaptive_keeps_decode_eviction_and_counts_split_layers_without_it():
    config = engine_config(budget=64, window=8, full_layers=0)
    kv = KVCacheManager([FULL] * 4, 400, BS, 3, 2, torch.float32)
    policy = resolve(config, {"head_budgets": "adaptive"}, kv=kv, n=200, max_tokens=40)
    assert policy.kv == KVPolicy(
        decode_eviction=True, bounded_chunks=False, head_wise=True, side_pages=1
    )
    # Per layer: 64 kept + 40 grown without eviction -> 7 pages, plus one page per KV head;
    # side state 4 x 3 heads x 8 x 2 x 4 B = 768 B, one 768-byte page.
    assert policy.peak_pages == (4 * (7 + 3) + 1,)
    flat = resolve(config, {"head_budgets": "flat"}, kv=kv, n=200, max_tokens=40)
    assert flat.peak_pages == (4 * 5 + 1,)  # min(240, 64 + 16) slots
    # A prompt under the budget splits no layer: every layer counts as flat, eviction included.
    fits = resolve(config, {"head_budgets": "adaptive"}, kv=kv, n=40, max_tokens=100)
    assert fits.peak_pages == (4 * 5 + 1,)  # min(140, max(40, 64 + 16)) slots, no slack
    one_head = resolve(config, {"head_budgets": "adaptive"}, n=200, max_tokens=40)
    assert one_head.kv == KVPolicy(
        decode_eviction=True, bounded_chunks=False, head_wise=False, side_pages=1
    )


def test_per_layer_budgets_and_fractions_replace_each_other_per_request():
    base = CompressionConfig(window=8, layer_budgets=(0, 64, 64, 64))
    merged = base.merged({"layer_fractions": [1.0, 0.5, 0.5, 0.5]})
    assert merged.layer_fractions == (1.0, 0.5, 0.5, 0.5) and merged.layer_budgets is None
    back = merged.merged({"layer_budgets": [0, 32, 32, 32]})
    assert back.layer_budgets == (0, 32, 32, 32) and back.layer_fractions is None
    with pytest.raises(ValueError, match="layer_fractions and kv_compression.layer_budgets"):
        base.merged({"layer_fractions": [1.0] * 4, "layer_budgets": [0] * 4})


def test_the_request_object_takes_every_policy_field():
    import dataclasses

    from sparsekv.server.protocol import KVCompressionBody

    assert set(KVCompressionBody.model_fields) == {
        f.name for f in dataclasses.fields(CompressionConfig)
    }
