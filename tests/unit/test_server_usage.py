"""The server's ``usage`` object: OpenAI's counts, ``prompt_tokens_details.cached_tokens``
(always present; once per request, as ``prompt_tokens``) and the KV footprint fields."""

from __future__ import annotations

from sparsekv.outputs import CompletionOutput, KVStats, RequestOutput
from sparsekv.server.serving import usage


def test_usage_counts_prompt_and_cached_tokens_once_per_request():
    samples = [CompletionOutput(0, "a", [5, 6], "length"), CompletionOutput(1, "b", [7], "stop")]
    stats = KVStats([10, 10], [0, 0], 10)
    output = RequestOutput("r", list(range(8)), samples, True, stats, num_cached_tokens=4)
    assert usage(output) == {
        "prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
        "kv_tokens_kept": 10.0, "kv_tokens_full": 10,
        "kv_compression_ratio": 0.0, "kv_sliding_window_ratio": 0.0,
    }  # fmt: skip


def test_cached_tokens_is_zero_without_a_hit_or_prefix_caching():
    output = RequestOutput("r", [1, 2, 3], [CompletionOutput(0, "", [], "abort")], True)
    assert usage(output)["prompt_tokens_details"] == {"cached_tokens": 0}
