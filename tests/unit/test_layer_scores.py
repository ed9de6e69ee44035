"""``layer_scores``: the setting, its flag, and the first-layer scores a request's step keeps
(``runner.layer_scores``). The engine-level kept sets are in tests/model (KVzip against the
dense reconstruction reference, head-wise SnapKV)."""

from __future__ import annotations

import argparse

import pytest
import torch

from sparsekv.cli_args import add_engine_args, engine_config_from_args
from sparsekv.compression.base import LayerView
from sparsekv.compression.registry import get_compressor
from sparsekv.config import CompressionConfig
from sparsekv.runner.layer_scores import shared_scores
from sparsekv.runner.metadata import RequestSlice


def test_setting_is_validated_and_reaches_the_compressor():
    with pytest.raises(ValueError, match="kv_compression.layer_scores must be own or first"):
        CompressionConfig(layer_scores="last").validate()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-compression", "kvzip", "--kv-layer-scores", "first"])
    config = engine_config_from_args(args)
    assert config.compression.layer_scores == "first"
    assert get_compressor(config.compression).layer_scores == "first"
    assert get_compressor(CompressionConfig()).layer_scores == "own"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-layer-scores", "last"])


def view_of(n, seed, num_kv_heads=2, group=2, window=4):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_kv_heads, n, 8, generator=generator)
    queries = torch.randn(num_kv_heads * group, window, 8, generator=generator)
    return LayerView(keys, keys.clone(), queries, None, 8**-0.5)


def request_of(layer_scores):
    compressor = get_compressor(CompressionConfig(window=4, layer_scores=layer_scores))
    return RequestSlice("r", 0, 1, [], None, compressor, 4)


def test_first_layer_scores_serve_the_later_layers_of_the_step():
    request = request_of("first")
    first, later = view_of(40, seed=0), view_of(40, seed=1)
    scores = shared_scores(request, first, budget=16)
    assert torch.equal(scores, request.compressor.ranking_scores(first))
    assert shared_scores(request, later, budget=16) is scores
    assert not torch.equal(scores, request.compressor.ranking_scores(later))
    # A layer that keeps every slot, or holds another count of slots, scores its own.
    assert shared_scores(request, later, budget=40) is None
    assert shared_scores(request, view_of(36, seed=2), budget=16) is None
    # The kept slots of a later layer are the first layer's.
    kept_first = request.compressor.select(first, 16, 4)
    assert torch.equal(request.compressor.select(later, 16, 4, scores), kept_first)


def test_own_scores_by_default():
    request = request_of("own")
    assert shared_scores(request, view_of(40, seed=0), budget=16) is None
    assert request.first_layer_scores is None
