"""Which heads, MLP columns and vocabulary rows each tensor-parallel rank holds."""

from __future__ import annotations

import pytest

from sparsekv.distributed.tp_layout import rank_shard, replica_groups, split_evenly
from sparsekv.parallel_config import ParallelConfig


def shards(num_heads, num_kv_heads, world, intermediate=10, vocab=11):
    return [
        rank_shard(r, world, num_heads, num_kv_heads, intermediate, vocab) for r in range(world)
    ]


def test_whole_groups_dealt_in_order():
    a, b = shards(4, 2, 2)
    assert (a.q_start, a.q_count, a.kv_start, a.kv_count) == (0, 2, 0, 1)
    assert (b.q_start, b.q_count, b.kv_start, b.kv_count) == (2, 2, 1, 1)
    assert not a.replicated and a.replica_ranks == (0,)


def test_uneven_split_gives_the_first_ranks_one_more_group():
    a, b = shards(6, 3, 2)
    assert (a.q_start, a.q_count, a.kv_start, a.kv_count) == (0, 4, 0, 2)
    assert (b.q_start, b.q_count, b.kv_start, b.kv_count) == (4, 2, 2, 1)
    # SmolLM2: 9 query / 3 KV heads on 2 ranks.
    a, b = shards(9, 3, 2)
    assert (a.q_count, a.kv_count, b.q_start, b.q_count) == (6, 2, 6, 3)


def test_fewer_kv_heads_than_ranks_replicates_them():
    a, b = shards(4, 1, 2)
    assert (a.kv_start, b.kv_start) == (0, 0)
    assert (a.q_start, a.q_count, b.q_start, b.q_count) == (0, 2, 2, 2)
    assert a.replicated and a.replica_ranks == b.replica_ranks == (0, 1)
    assert replica_groups(2, 4) == [(0, 1), (2, 3)]
    assert replica_groups(2, 2) == []
    c = rank_shard(3, 4, 8, 2, 16, 16)
    assert (c.kv_start, c.q_start, c.q_count, c.replica_ranks) == (1, 6, 2, (2, 3))


def test_mlp_and_vocabulary_chunks_cover_everything_once():
    parts = shards(4, 2, 2, intermediate=9, vocab=11)
    assert [(s.mlp_start, s.mlp_count) for s in parts] == [(0, 5), (5, 4)]
    assert [(s.vocab_start, s.vocab_count) for s in parts] == [(0, 6), (6, 5)]
    assert all(s.vocab_chunk == 6 and s.vocab_size == 11 for s in parts)
    assert [split_evenly(10, 3, i) for i in range(3)] == [(0, 4), (4, 3), (7, 3)]


@pytest.mark.parametrize(
    ("heads", "kv", "world", "message"),
    [
        (4, 2, 8, "8 ranks but the model has 4 query heads"),
        (6, 2, 3, "must be a multiple of the KV heads"),
        (2, 1, 4, "4 ranks but the model has 2 query heads"),
        (6, 1, 4, "do not split over its 4 replicas"),
    ],
)
def test_layouts_that_do_not_shard_are_refused(heads, kv, world, message):
    with pytest.raises(ValueError, match="tensor_parallel_size") as info:
        rank_shard(0, world, heads, kv, 64, 64)
    assert message in str(info.value)


def test_parallel_config_checks_the_tensor_parallel_fields():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        ParallelConfig(tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="tensor_parallel_timeout must be > 0"):
        ParallelConfig(tensor_parallel_timeout=0).validate()
    with pytest.raises(ValueError, match="tensor_parallel_size: replicas"):
        ParallelConfig(tensor_parallel_size=2, data_parallel_size=2).validate()


@pytest.mark.parametrize(
    ("cache", "model", "message"),
    [
        ({"kv_cache_dtype": "int4"}, {}, "--kv-cache-dtype int4"),
        ({}, {"weight_dtype": "int8"}, "--weight-dtype int8"),
    ],
)
def test_settings_the_ranks_cannot_shard_are_refused_before_any_process(cache, model, message):
    from sparsekv.config import CacheConfig, EngineConfig, ModelConfig
    from sparsekv.engine.engine_setup import build_engine_parts

    config = EngineConfig(
        model=ModelConfig(**model),
        cache=CacheConfig(**cache),
        parallel=ParallelConfig(tensor_parallel_size=2),
    )
    with pytest.raises(ValueError, match="tensor_parallel_size") as info:
        build_engine_parts(config, checkpoint=object())
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"speculative": {"method": "ngram"}}, "speculative decoding"),
        ({"model": {"weight_dtype": "gguf"}}, "--weight-dtype gguf"),
        ({"cache": {"kv_cache_dtype": "int4"}}, "int4"),
        ({"compression": {"method": "kvzip"}}, "kvzip"),
    ],
)
def test_unsupported_settings_are_refused_before_any_rank_starts(fields, message):
    from sparsekv.config import (
        CacheConfig,
        CompressionConfig,
        EngineConfig,
        ModelConfig,
        SpeculativeConfig,
    )
    from sparsekv.distributed.tp_launch import check_supported

    parts = {
        "model": ModelConfig,
        "cache": CacheConfig,
        "compression": CompressionConfig,
        "speculative": SpeculativeConfig,
    }
    kwargs = {name: parts[name](**values) for name, values in fields.items()}
    config = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2), **kwargs)
    with pytest.raises(ValueError, match="tensor_parallel_size") as error:
        check_supported(config)
    assert message in str(error.value)
