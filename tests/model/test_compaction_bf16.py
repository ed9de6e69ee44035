"""SmolLM2 in bf16 with decode-time eviction: compaction read from the pages
(``runner.compaction``, the fused window kernels) gives the same tokens and kept counts as the gathered
route."""

from __future__ import annotations

import pytest

from sparsekv.config import CompressionConfig
from sparsekv.runner import compaction
from sparsekv.sampling_params import SamplingParams
from tests.conftest import run_to_completion

# A fused window kernel (AMX, AVX512-BF16, AVX2 or portable) reads the pages: deselected, and
# named untested, only where the native kernels do not build or are off.
pytestmark = pytest.mark.kernel_variant("window_fused")


def _run(engine, tokenizer):
    story = tokenizer.encode("Once upon a time in a small village by the sea, " * 12)
    other = tokenizer.encode("The history of the printing press begins in Mainz. " * 10)
    params = SamplingParams(max_tokens=56, temperature=0.0, ignore_eos=True)
    requests = [("a", story, params), ("b", story, params), ("c", other, params)]
    outputs = run_to_completion(engine, requests)
    return {
        rid: (out.outputs[0].token_ids, out.kv_stats.kept_per_layer) for rid, out in outputs.items()
    }


def test_page_compaction_equals_gathered_route(
    make_engine, smollm2_checkpoint, smollm2_tokenizer, monkeypatch
):
    calls = []
    original = compaction.compact_from_pages

    def counted(*args):
        calls.append(len(args[1]))
        return original(*args)

    monkeypatch.setattr(compaction, "compact_from_pages", counted)
    policy = CompressionConfig(method="snapkv", budget=64, full_layers=2)
    # No prefix cache: the second run must not hit the first one's pages.
    engine = make_engine(
        smollm2_checkpoint,
        compression=policy,
        dtype="bfloat16",
        num_pages=600,
        prefix_caching=False,
    )
    fast = _run(engine, smollm2_tokenizer)
    # Each request compacts its 28 budgeted layers together every 16 decode steps.
    assert len(calls) >= 9 and set(calls) == {28}

    monkeypatch.setattr(compaction, "applies", lambda *args: False)
    gathered = _run(engine, smollm2_tokenizer)
    assert fast == gathered
    for rid, (tokens, kept) in fast.items():
        assert len(tokens) == 56
        # Full layers hold prompt + output - 1 slots; budgeted ones at most budget + block.
        assert kept[2:] == [kept[2]] * 28 and 64 <= kept[2] < 64 + 16, (rid, kept)
        assert kept[0] == kept[1] > 64 + 16
