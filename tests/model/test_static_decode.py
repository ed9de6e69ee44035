"""The static-buffer (graph-ready) decode path equals the eager path.

Engines over the same random-weight model (Llama 3, Gemma 2, Gemma 3) run the same requests, one eagerly, one with the
static decode path (``ModelRunner.use_static_decode`` without capture: what a CUDA graph would
replay, run eagerly on CPU). The static path runs with ``Tensor.item``, ``Tensor.tolist`` and
``nonzero`` patched to raise (no host sync in the forward, the logging of its side effects or
the decode-time compactions after it), keeps its tensors at the same addresses, and gives the
same greedy tokens, logits (fp32, 1e-5) and SnapKV kept slots as the eager path.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.compression.snapkv import SnapKVCompressor
from sparsekv.config import CompressionConfig
from sparsekv.runner.static_decode import StaticDecodeRunner, batch_buckets
from sparsekv.sampling_params import SamplingParams
from tests.model.family_models import checkpoint_of, random_hf_model, tiny_config
from tests.model.family_models import make_engine as make_tiny_engine
from tests.model.test_gemma3 import checkpoint_of as gemma3_checkpoint
from tests.model.test_gemma3 import random_hf_model as random_gemma3
from tests.model.test_gemma3 import tiny_config as gemma3_config

SNAPKV = CompressionConfig(method="snapkv", budget=24, window=4, full_layers=0)
NONE = CompressionConfig(method="none")
PROMPTS = [[5 + (7 * i) % 400 for i in range(n)] for n in (40, 23, 31)]


def _raise(*args, **kwargs):
    raise AssertionError("host sync on the static decode path")


def _no_host_syncs(patch) -> None:
    for name in ("item", "tolist", "nonzero"):
        patch.setattr(torch.Tensor, name, _raise)
    patch.setattr(torch, "nonzero", _raise)


@pytest.fixture(scope="module")
def checkpoints():
    llama = tiny_config("llama3")
    llama.num_hidden_layers = 2
    return {
        "llama3": checkpoint_of(random_hf_model(llama, seed=3)),
        "gemma2": checkpoint_of(random_hf_model(tiny_config("gemma2"), seed=5)),
        "gemma3": gemma3_checkpoint(random_gemma3(gemma3_config(), seed=7)),
    }


def _run(checkpoint, policy, static: bool, monkeypatch, params=None, engine=None, prompts=None):
    """Greedy generation of ``prompts`` (added one step apart, so the batch grows through the
    buckets): per request (tokens, logits ``[n, vocab]``), every kept-slot selection, and the
    static runner's tensor addresses after each static step."""
    if engine is None:
        engine = make_tiny_engine(
            checkpoint, compression=policy, prefix_caching=False, max_num_seqs=4
        )
    runner = engine.parts.runner
    addresses = []
    if static:
        runner.use_static_decode(4, engine.parts.max_model_len, capture=False)
        static_runner = runner.static_decode
        run = StaticDecodeRunner.run

        def checked(self, *args):
            with monkeypatch.context() as patch:
                _no_host_syncs(patch)
                logits = run(self, *args)
            # The logits are the graph's output under capture; eagerly, a fresh tensor.
            buffers = (self.tokens, self.tables, self.counts, self.query_log)
            addresses.append(tuple(t.data_ptr() for t in buffers))
            return logits

        monkeypatch.setattr(StaticDecodeRunner, "run", checked)
    kept = []
    keep_top = SnapKVCompressor.keep_top

    # Every selection (prefill, decode-time from gathered rows or straight from the pages)
    # ranks its scores through ``keep_top``.
    def recording(self, scores, budget, window, backend=None):
        chosen = keep_top(self, scores, budget, window, backend)
        kept.append(chosen.clone())
        return chosen

    monkeypatch.setattr(SnapKVCompressor, "keep_top", recording)
    params = params or SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    requests, outputs = {}, {}
    for i, prompt in enumerate(prompts or PROMPTS):
        engine.add_request(f"r{i}", prompt, params, collect_logits=True)
        requests[f"r{i}"] = engine._groups[f"r{i}"].samples[0].request
        engine.step()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                logits = torch.stack(requests[out.request_id].logits)
                outputs[out.request_id] = (out.outputs[0].token_ids, logits)
    engine.kv.check_invariants()
    monkeypatch.undo()
    if static:
        assert static_runner.rows_copied > 0
    return outputs, kept, addresses


@pytest.mark.parametrize("family", ["llama3", "gemma2", "gemma3"])
@pytest.mark.parametrize("policy", [NONE, SNAPKV], ids=["full", "snapkv"])
def test_static_decode_equals_eager(checkpoints, family, policy, monkeypatch):
    checkpoint = checkpoints[family]
    want, want_kept, _ = _run(checkpoint, policy, False, monkeypatch)
    got, got_kept, addresses = _run(checkpoint, policy, True, monkeypatch)
    assert len(addresses) >= 10  # the decode steps ran on the static path
    assert set(addresses) == {addresses[0]}  # buckets 1, 2, 4 share the tensors
    assert sorted(got) == sorted(want)
    for request_id, (tokens, logits) in want.items():
        assert got[request_id][0] == tokens
        torch.testing.assert_close(got[request_id][1], logits, rtol=0, atol=1e-5)
    assert len(got_kept) == len(want_kept)
    if policy is SNAPKV:
        assert len(want_kept) > 6  # prefill compressions and decode-time evictions
    for a, b in zip(got_kept, want_kept):
        assert torch.equal(a, b)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="max_num_seqs"):
        batch_buckets(0)


def test_capture_needs_cuda(checkpoints):
    engine = make_tiny_engine(checkpoints["llama3"], prefix_caching=False)
    with pytest.raises(ValueError, match="capture"):
        engine.parts.runner.use_static_decode(4, 64, capture=True)


def test_seeded_sampling_on_the_static_path_repeats_the_eager_draws(checkpoints, monkeypatch):
    """Seeded sampling draws from per-request generators on the engine device: the static path
    samples exactly the eager path's tokens, and a second run repeats them."""
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    engine = make_tiny_engine(checkpoints["llama3"], prefix_caching=False)
    engine.add_request("x", PROMPTS[0], params)
    generator = engine._groups["x"].samples[0].request.generator
    assert generator.device == engine.parts.runner.device
    want, _, _ = _run(checkpoints["llama3"], NONE, False, monkeypatch, params=params)
    got, _, _ = _run(checkpoints["llama3"], NONE, True, monkeypatch, params=params)
    again, _, _ = _run(checkpoints["llama3"], NONE, True, monkeypatch, params=params)
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in want.items()}
    assert {r: t for r, (t, _) in again.items()} == {r: t for r, (t, _) in want.items()}
    assert len({tuple(t) for t, _ in want.values()}) == 3


@pytest.mark.slow
def test_static_decode_equals_eager_on_smollm2(smollm2_checkpoint, make_engine, monkeypatch):
    """The real SmolLM2-135M (30 layers, GQA 3:1), fp32, SnapKV with decode-time evictions."""
    policy = CompressionConfig(method="snapkv", budget=32, window=8, full_layers=2)
    params = SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True)
    prompts = [[100 + (13 * i) % 9000 for i in range(n)] for n in (60, 41, 52)]
    results = []
    for static in (False, True):
        engine = make_engine(smollm2_checkpoint, compression=policy, prefix_caching=False)
        results.append(_run(None, policy, static, monkeypatch, params, engine, prompts))
    (want, want_kept, _), (got, got_kept, addresses) = results
    assert len(addresses) >= 15 and set(addresses) == {addresses[0]}
    for request_id, (tokens, logits) in want.items():
        assert got[request_id][0] == tokens
        # 30 layers of GEMMs over a padded bucket (4 rows for 3) round differently: ~1e-4
        # on logits of magnitude ~10.
        torch.testing.assert_close(got[request_id][1], logits, rtol=2e-5, atol=1e-4)
    assert len(want_kept) > 3 * 28 and len(got_kept) == len(want_kept)
    for a, b in zip(got_kept, want_kept):
        assert torch.equal(a, b)
