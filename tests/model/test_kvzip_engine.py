"""KVzip in the paged engine: kept slots equal a brute-force dense reconstruction pass.

The reference runs the model densely (float64 softmax over every position, no cache) over the
prompt followed by each reconstruction segment, takes per layer and KV head the largest
probability any reconstruction row of a query head puts on a prompt position, combines the
group's query heads (max or mean), max-pools it over neighbouring positions, keeps the sinks
and the observation window, and ranks the rest with ties to the more recent position. The
engine must keep exactly those slots (every budgeted layer those of the first with
``layer_scores="first"``), and hold only the compressed pages.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparsekv.compression.kvzip import KVzipCompressor, repeat_prompt
from sparsekv.config import CompressionConfig
from sparsekv.sampling_params import SamplingParams
from tests.conftest import record_selections, tiny_checkpoint, tiny_llama_config
from tests.unit.test_compression import ref_pool

GREEDY = dict(temperature=0.0, ignore_eos=True)
LAYERS, BUDGET, WINDOW, SINKS = 4, 24, 4, 4
KERNEL = 5  # the scores' max-pool kernel


@pytest.fixture(scope="module", params=["gqa", "mha"])
def tiny(request, smollm2_tokenizer):
    heads = (4, 2) if request.param == "gqa" else (4, 4)
    config = tiny_llama_config(num_heads=heads[0], num_kv_heads=heads[1], num_layers=LAYERS)
    return tiny_checkpoint(config, smollm2_tokenizer, seed=11)[0]


def prompt_of(length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, 49000, (length,), generator=generator).tolist()


class DenseRecorder:
    """Plain causal attention in float64 over one sequence; keeps each layer's q and k."""

    def __init__(self):
        self.queries, self.keys, self.scale = {}, {}, None

    def attend(self, layer, q, k, v, scale, sliding_window=None):
        q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # [heads, T, d]
        self.queries[layer], self.keys[layer], self.scale = q, k, scale
        group = q.shape[0] // k.shape[0]
        probs = causal_softmax(q, k.repeat_interleave(group, 0), scale)
        out = probs @ v.repeat_interleave(group, 0)
        return out.transpose(0, 1).float()


def causal_softmax(q, k, scale):
    logits = q @ k.transpose(1, 2) * scale
    size = logits.shape[-1]
    mask = torch.ones(size, size, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def reference_kept(model, prompt, segments, layers, gqa_agg="max"):
    """Per layer of ``layers``: sorted kept positions per KV head."""
    n = len(prompt)
    best = {}
    for segment in segments:
        recorder = DenseRecorder()
        ids = torch.tensor(prompt + segment)
        positions = torch.tensor(list(range(n)) + list(range(n, n + len(segment))))
        with torch.inference_mode():
            model(ids, positions, recorder)
        for layer in layers:
            q, k = recorder.queries[layer], recorder.keys[layer]
            group = q.shape[0] // k.shape[0]
            probs = causal_softmax(q, k.repeat_interleave(group, 0), recorder.scale)
            rows = probs[:, n:, :n].amax(dim=1)  # [heads, n]
            best[layer] = rows if layer not in best else torch.maximum(best[layer], rows)
    kept = {}
    for layer, per_head in best.items():
        grouped = per_head.reshape(len(per_head) // group, group, n)
        unpooled = grouped.amax(dim=1) if gqa_agg == "max" else grouped.mean(dim=1)
        scores = ref_pool(unpooled, "max", KERNEL)
        heads = []
        for head in scores:
            older = [(float(head[j]) if j >= SINKS else float("inf"), j) for j in range(n - WINDOW)]
            chosen = sorted(older, reverse=True)[: BUDGET - WINDOW]  # ties: higher index first
            heads.append(sorted([j for _, j in chosen] + list(range(n - WINDOW, n))))
        kept[layer] = heads
    return kept


def record_prompt_selections(monkeypatch, chunk_size):
    built = KVzipCompressor.from_config

    def from_config(cls, config):
        return dataclasses.replace(built(config), chunk_size=chunk_size)

    monkeypatch.setattr(KVzipCompressor, "from_config", classmethod(from_config))

    def prompt(view, scores):  # the prompt's compression: reconstruction rows or shared scores
        return bool(view.reconstruction) or scores is not None

    return record_selections(monkeypatch, KVzipCompressor, keep=prompt)


@pytest.mark.parametrize(
    "chunk_size, gqa_agg, layer_scores",
    [(2048, "max", "own"), (24, "max", "own"), (2048, "mean", "own"), (24, "mean", "first")],
)
def test_kept_slots_equal_the_dense_reconstruction_reference(
    tiny, make_engine, monkeypatch, smollm2_tokenizer, chunk_size, gqa_agg, layer_scores
):
    kept = record_prompt_selections(monkeypatch, chunk_size)
    policy = CompressionConfig(
        method="kvzip",
        budget=BUDGET,
        window=WINDOW,
        full_layers=1,
        kernel_size=KERNEL,
        gqa_agg=gqa_agg,
        layer_scores=layer_scores,
    )
    engine = make_engine(tiny, block_size=4, prefix_caching=False)
    prompt = prompt_of(60, seed=1)
    engine.add_request("z", prompt, SamplingParams(max_tokens=3, **GREEDY), policy)
    while engine.has_unfinished_requests():
        engine.step()
    compressor = KVzipCompressor(chunk_size=chunk_size, repeat=repeat_prompt(smollm2_tokenizer))
    segments = compressor.reconstruction_segments(prompt)
    assert len(segments) == (1 if chunk_size == 2048 else 3)
    assert segments[0][-len(prompt) if chunk_size == 2048 else -24 :] == prompt[:chunk_size]
    expected = reference_kept(engine.parts.model, prompt, segments, range(1, LAYERS), gqa_agg)
    assert len(kept) == LAYERS - 1  # one selection per budgeted layer, at the prompt's end
    for layer, chosen in zip(range(1, LAYERS), kept):
        source = 1 if layer_scores == "first" else layer
        assert [sorted(row) for row in chosen.tolist()] == expected[source], layer
    if layer_scores == "first":  # the layers' own scores keep other slots
        assert any(expected[layer] != expected[1] for layer in range(2, LAYERS))


def test_reconstruction_kv_never_stays_and_pages_are_freed(tiny, make_engine):
    policy = CompressionConfig(method="kvzip", budget=32, window=4, full_layers=0)
    engine = make_engine(tiny, block_size=4, prefix_caching=False)
    prompt = prompt_of(400, seed=6)
    engine.add_request("s", prompt, SamplingParams(max_tokens=4, **GREEDY), policy)
    scheduled = engine.scheduler.schedule()
    # The single-shot prefill holds the compressed footprint only: 8 pages per layer, never
    # the 100 of the prompt, nor any page for the ~420 reconstruction rows; besides them, the
    # pages standing for the stored window queries (kv_cache.side_state).
    side = len(engine.kv.get("s").side_pages)
    assert side == engine.scheduler.running[0].policy.kv.side_pages > 0
    assert engine.kv.num_total_pages - engine.kv.num_free_pages - side <= LAYERS * (32 // 4)
    assert engine.runner.execute(scheduled).token_ids
    engine.scheduler.update(scheduled)
    engine.abort_request("s")
    engine.add_request("t", prompt, SamplingParams(max_tokens=4, **GREEDY), policy)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    assert final.outputs[0].token_ids and len(final.outputs[0].token_ids) == 4
    # Budget + the 3 decoded tokens fed back: the reconstruction rows left nothing behind.
    assert final.kv_stats.kept_per_layer == [32 + 3] * LAYERS
    assert final.kv_stats.evicted_per_layer == [400 - 32] * LAYERS


def test_context_scope_compresses_the_context_only(tiny, make_engine):
    context, question = prompt_of(80, seed=2), prompt_of(9, seed=3)
    policy = CompressionConfig(
        method="kvzip", budget=40, window=4, full_layers=1, scope="context", context_tokens=80
    )
    engine = make_engine(tiny, block_size=4)
    engine.add_request("c", context + question, SamplingParams(max_tokens=5, **GREEDY), policy)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    kept = final.kv_stats.kept_per_layer
    assert kept == [89 + 4] + [40 + 9 + 4] * (LAYERS - 1)


def test_a_kvzip_request_batched_with_others_equals_alone(tiny, make_engine):
    kvzip = CompressionConfig(method="kvzip", budget=24, window=4, full_layers=1)
    snap = CompressionConfig(method="snapkv", budget=24, window=4, full_layers=1)
    prompts = {"k": (prompt_of(70, seed=4), kvzip), "s": (prompt_of(50, seed=5), snap)}
    params = SamplingParams(max_tokens=8, **GREEDY)
    alone = {}
    for name, (prompt, policy) in prompts.items():
        engine = make_engine(tiny, block_size=4)
        engine.add_request(name, prompt, params, policy)
        while engine.has_unfinished_requests():
            for output in engine.step():
                alone[name] = output.outputs[0].token_ids
    engine = make_engine(tiny, block_size=4)
    for name, (prompt, policy) in prompts.items():
        engine.add_request(name, prompt, params, policy)
    together = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            together[output.request_id] = output.outputs[0].token_ids
    assert together == alone


def test_chunked_prefill_equals_one_shot(tiny, make_engine):
    policy = CompressionConfig(method="kvzip", budget=24, window=4, full_layers=1)
    prompt = prompt_of(90, seed=7)
    params = SamplingParams(max_tokens=10, **GREEDY)
    outputs = []
    for chunk in (None, 16):
        extra = {} if chunk is None else {"max_num_batched_tokens": chunk}
        engine = make_engine(tiny, block_size=4, **extra)
        engine.add_request("c", prompt, params, policy)
        final = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                final = output
        outputs.append((final.outputs[0].token_ids, final.kv_stats.kept_per_layer))
    # The last chunk compresses over the gathered chunks plus its own rows: same kept slots.
    assert outputs[1] == outputs[0] and len(outputs[0][0]) == 10


class RowCounter:
    """Counts the rows each layer's attention sees in each step (wraps ``attend``)."""

    def __init__(self, monkeypatch):
        from sparsekv.runner.paged_attention import PagedAttention

        self.steps = []
        attend = PagedAttention.attend

        def counting(ctx, layer, q, *args, **kwargs):
            if layer == 0:
                self.steps.append([])
            self.steps[-1].append(q.shape[0])
            return attend(ctx, layer, q, *args, **kwargs)

        monkeypatch.setattr(PagedAttention, "attend", counting)


def run_batch(engine, requests):
    for name, prompt, params, policy in requests:
        engine.add_request(name, prompt, params, policy)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = outcome(output)
    return results


def outcome(output):
    """Tokens, logprobs, prompt logprobs and kept slots of a finished request."""
    prompt = [None if x is None else round(x.logprob, 5) for x in output.prompt_logprobs or []]
    return (
        output.outputs[0].token_ids,
        [round(x.logprob, 5) for x in output.outputs[0].logprobs],
        prompt,
        output.kv_stats.kept_per_layer,
    )


def test_reconstruction_rows_leave_after_the_last_layer_that_scores(tiny, make_engine, monkeypatch):
    """With first-layer scores a KVzip request's rows stop after layer 1 (the first budgeted
    layer), with its own scores after the last layer. Beside them, in the same steps: a
    decoding request before their rows, a SnapKV prefill after them (both with logprobs, the
    SnapKV one with prompt logprobs), then a KVzip prompt that hits the prefix cache. Every
    output equals a run whose rows go through every layer."""
    from sparsekv.runner.paged_attention import PagedAttention

    first = CompressionConfig(
        method="kvzip", budget=24, window=4, full_layers=1, layer_scores="first"
    )
    own = CompressionConfig(method="kvzip", budget=24, window=4, full_layers=1)
    snap = CompressionConfig(method="snapkv", budget=24, window=4, full_layers=1)
    params = SamplingParams(max_tokens=6, logprobs=2, **GREEDY)
    with_prompt = SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=1, **GREEDY)
    shared = prompt_of(70, seed=4)
    batch = [
        ("k", shared, with_prompt, first),
        ("o", prompt_of(60, seed=9), params, own),
        ("s", prompt_of(50, seed=5), with_prompt, snap),
    ]

    def run(exit_early):
        counter = RowCounter(monkeypatch)
        if not exit_early:
            monkeypatch.setattr(PagedAttention, "rows_after", lambda ctx, layer: None)
        engine = make_engine(tiny, block_size=4, prefix_cache_uncompressed=True)
        engine.add_request("d", prompt_of(30, seed=8), params, snap)
        engine.step()  # "d" prefills alone, then decodes beside the others
        results = run_batch(engine, batch)
        hit = run_batch(engine, [("p", shared[:48] + prompt_of(30, seed=10), params, first)])
        monkeypatch.undo()
        return results | hit, counter.steps

    early, early_rows = run(True)
    full, full_rows = run(False)
    assert early == full and set(early) == {"d", "k", "o", "s", "p"}
    assert len(early["s"][2]) == 50 and early["s"][2][0] is None
    # The batched step: 1 decode row + 180 prompt rows + the two KVzip requests' rows in
    # layers 0 and 1; then only the own-scores request's rows until its last layer.
    batched = next(i for i, rows in enumerate(full_rows) if rows[0] > 181)
    recon = full_rows[batched][0] - 181
    recon_own = early_rows[batched][2] - 181
    assert 0 < recon_own < recon and full_rows[batched] == [181 + recon] * LAYERS
    assert early_rows[batched] == [181 + recon] * 2 + [181 + recon_own] * (LAYERS - 2)
    # The prefix hit: its new rows after layer 1, fewer than its 78 tokens.
    hit_rows = next(rows for rows in reversed(early_rows) if rows[0] > 4)
    assert hit_rows[2:] == [hit_rows[2]] * (LAYERS - 2) and hit_rows[2] < 78 < hit_rows[0]
    assert next(rows for rows in reversed(full_rows) if rows[0] > 4) == [hit_rows[0]] * LAYERS
    assert early_rows[:batched] == full_rows[:batched]


def test_own_scores_keep_the_rows_to_the_last_compressing_layer():
    from sparsekv.kv_cache.plan import LayerStep
    from sparsekv.runner.layer_scores import last_reconstruction_layer

    def step(compress_to, held=0, new=60, **kwargs):
        return LayerStep([], 0, held, new, compress_to, **kwargs)

    layers = [step(None), step(24), step(24), step(None), step(24)]  # 60 slots each
    own = KVzipCompressor(layer_scores="own")
    first = KVzipCompressor(layer_scores="first")
    assert last_reconstruction_layer(own, layers) == 4
    assert last_reconstruction_layer(first, layers) == 1
    # A later layer holding another count of slots scores its own rows.
    assert last_reconstruction_layer(first, layers[:4] + [step(24, held=8)]) == 4
    # Layers that compact at decode time score nothing.
    assert last_reconstruction_layer(own, [step(60), step(24, decode_compaction=True)]) is None
