"""The tensor-parallel compressor adapter on one rank without a process group: the calls the
runner makes on a request's compressor (select with and without shared scores, ranking_scores,
keep_top for the page-path compaction) give what the inner compressor gives on the rank's
heads."""

from __future__ import annotations

import torch

from sparsekv.compression.base import LayerView
from sparsekv.compression.registry import get_compressor
from sparsekv.config import CompressionConfig
from sparsekv.distributed.tp_compression import ShardedCompressor
from sparsekv.distributed.tp_layout import rank_shard


def view_of(n, seed, num_kv_heads=2, group=3):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_kv_heads, n, 8, generator=generator)
    queries = torch.randn(num_kv_heads * group, 4, 8, generator=generator)
    return LayerView(keys, keys.clone(), queries, None, 8**-0.5)


def test_sharded_compressor_answers_every_call_of_the_runner():
    inner = get_compressor(CompressionConfig(window=4, layer_scores="first"))
    shard = rank_shard(0, 2, 12, 4, 10, 11)  # two whole groups of three per rank
    sharded = ShardedCompressor(inner, shard)
    view = view_of(40, seed=0)
    scores = sharded.ranking_scores(view)
    assert torch.equal(scores, inner.ranking_scores(view))
    assert torch.equal(sharded.select(view, 16, 4), inner.select(view, 16, 4))
    other = view_of(40, seed=1)
    assert torch.equal(sharded.select(other, 16, 4, scores), inner.select(view, 16, 4))
    assert torch.equal(sharded.keep_top(scores, 16, 4), inner.keep_top(scores, 16, 4))
    assert sharded.layer_scores == "first"
