"""Tensor parallelism over two gloo processes equals one process (tiny random Llamas, fp32).

Three head layouts: 4 query / 2 KV heads (one group per rank), 6 / 3 (uneven: 2 + 1 groups)
and 4 / 1 (the KV head replicated on both ranks, its four query heads split 2 + 2). Each runs
one TP = 2 engine (rank 1 spawned) beside a TP = 1 engine on the same weights: logits within
1e-5, greedy tokens equal with compression on, and per KV head the same kept slots (the cached
keys of every head, slot by slot).
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.config import CacheConfig, CompressionConfig, EngineConfig, ModelConfig
from sparsekv.distributed.tp_engine import snapshot_of
from sparsekv.engine.engine_setup import build_engine_parts
from sparsekv.engine.llm_engine import LLMEngine
from sparsekv.parallel_config import ParallelConfig
from sparsekv.sampling_params import SamplingParams
from tests.conftest import tiny_checkpoint, tiny_llama_config

pytestmark = pytest.mark.slow

LAYOUTS = {"4q-2kv": (4, 2), "6q-3kv-uneven": (6, 3), "4q-1kv-replicated": (4, 1)}
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Budget 16 of a 40-token prompt on every layer, window 4, 4-slot pages: prefill compresses,
# and decode-time eviction re-scores every 4 tokens.
POLICY = dict(budget=16, window=4, kernel_size=3, full_layers=0)


def build(checkpoint, tensor_parallel_size: int) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(kv_cache_memory=0.02, block_size=4),
        compression=CompressionConfig(method="none"),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
    )
    return LLMEngine(config, build_engine_parts(config, checkpoint))


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def engines(request, smollm2_tokenizer):
    num_heads, num_kv_heads = LAYOUTS[request.param]
    config = tiny_llama_config(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        hidden_size=16 * num_heads,
        head_dim=16,
        intermediate_size=90,  # 45 + 45 columns per rank
        vocab_size=1001,  # 501 + 500 rows per rank
    )
    checkpoint, _ = tiny_checkpoint(config, smollm2_tokenizer, seed=11)
    single = build(checkpoint, 1)
    sharded = build(checkpoint, 2)
    yield single, sharded
    sharded.shutdown()
    assert not sharded.runner.workers


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1001, (length,), generator=generator).tolist()


def run(engine: LLMEngine, requests, steps: int | None = None, on_step=None):
    """Add ``(request_id, prompt, params, policy)`` and step to the end (or ``steps`` steps);
    returns ``{request_id: (token ids, [logits per sampled position])}``."""
    for request_id, prompt, params, policy in requests:
        engine.add_request(request_id, prompt, params, policy, collect_logits=True)
    handles = {rid: engine._groups[rid].samples[0].request for rid, *_ in requests}
    done = {}
    count = 0
    while engine.has_unfinished_requests() and (steps is None or count < steps):
        for output in engine.step():
            if output.finished:
                assert output.error is None, output.error
                done[output.request_id] = output.outputs[0].token_ids
        count += 1
        if on_step is not None:
            on_step(engine, count)
    return {rid: (done.get(rid), handle.logits) for rid, handle in handles.items()}


def test_logits_equal_one_process(engines):
    single, sharded = engines
    requests = [
        ("a", prompt_of(40, 1), SamplingParams(max_tokens=8, **GREEDY), None),
        ("b", prompt_of(23, 2), SamplingParams(max_tokens=6, prompt_logprobs=2, **GREEDY), None),
    ]
    expected, got = run(single, requests), run(sharded, requests)
    for rid in ("a", "b"):
        assert got[rid][0] == expected[rid][0]
        torch.testing.assert_close(
            torch.stack(got[rid][1]), torch.stack(expected[rid][1]), rtol=0, atol=1e-5
        )


def test_greedy_tokens_equal_with_compression(engines):
    """One batch of four compressed requests: SnapKV, PyramidKV, ``random`` (every rank draws
    all heads' scores and keeps its rows) and H2O (replicated heads sum their mass)."""
    single, sharded = engines
    requests = [
        (method, prompt_of(40, 10 + i), SamplingParams(max_tokens=14, **GREEDY), policy)
        for i, method in enumerate(["snapkv", "pyramidkv", "random", "h2o"])
        for policy in [{"method": method, **POLICY}]
    ]
    expected, got = run(single, requests), run(sharded, requests)
    for rid, (tokens, logits) in expected.items():
        assert got[rid][0] == tokens, rid
        torch.testing.assert_close(torch.stack(got[rid][1]), torch.stack(logits), rtol=0, atol=1e-5)


def _all_heads(reports, layer: int) -> torch.Tensor:
    """One layer's cached keys of every KV head in model order from the ranks' reports;
    replicas of a KV head must hold the same slots."""
    heads = {}
    for shard, layers in reports:
        for i in range(shard.kv_count):
            keys = layers[layer][i]
            head = shard.kv_start + i
            if head in heads:
                torch.testing.assert_close(keys, heads[head], rtol=0, atol=0)
            heads[head] = keys
    return torch.stack([heads[h] for h in sorted(heads)])


def test_kept_slots_per_head_equal_one_process(engines):
    """Mid-generation (after the prefill compressed and two decode-time evictions), every
    layer's cached keys per KV head are TP = 1's, slot by slot: the same kept indices."""
    single, sharded = engines
    methods = ["snapkv", "pyramidkv"]
    requests = [
        (f"kept-{method}", prompt_of(40, 21), SamplingParams(max_tokens=16, **GREEDY), policy)
        for method in methods
        for policy in [{"method": method, **POLICY}]
    ]
    snapshots = {}

    def take(engine, step):
        if step != 12:
            return
        for method in methods:
            rid = f"kept-{method}"
            if engine is sharded:
                snapshots["tp", method] = engine.runner.snapshot_keys(rid)
            else:
                snapshots["single", method] = snapshot_of(engine.kv, rid)

    run(single, requests, on_step=take)
    run(sharded, requests, on_step=take)
    for method in methods:
        reference, reports = snapshots["single", method], snapshots["tp", method]
        assert [shard.rank for shard, _ in reports] == [0, 1]
        for layer, keys in enumerate(reference):
            assert keys.shape[1] < 40  # compressed
            torch.testing.assert_close(_all_heads(reports, layer), keys, rtol=0, atol=1e-5)


def test_a_reconstructing_policy_is_refused_per_request_and_the_group_lives_on(engines):
    single, sharded = engines
    prompt = prompt_of(40, seed=7)
    params = SamplingParams(max_tokens=3, **GREEDY)
    kvzip = CompressionConfig(method="kvzip", **POLICY)
    with pytest.raises(ValueError, match="kv_compression: kvzip is not supported"):
        sharded.add_request("kvzip", prompt, params, kvzip)
    assert not sharded.has_unfinished_requests()
    got = run(sharded, [("after", prompt, params, None)])
    want = run(single, [("after", prompt, params, None)])
    assert got["after"][0] == want["after"][0]
