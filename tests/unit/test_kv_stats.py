"""``KVStats``: the per-request KV figures of the API's usage (kept, full, compression and
sliding-window ratios)."""

from __future__ import annotations

from sparsekv.outputs import KVStats


def test_compressed_request_of_the_readme():
    # 2 full layers and 28 compressed to 79 slots of 149: 1960 of 4470 slots removed.
    stats = KVStats([149] * 2 + [79] * 28, [0] * 2 + [70] * 28, 149)
    assert stats.tokens_full == 149
    assert abs(stats.tokens_kept - 2510 / 30) < 1e-12
    assert stats.compression_ratio == 1960 / 4470
    assert stats.window_ratio == 0.0


def test_window_ratio_is_exact_zero_without_sliding_windows():
    for layers, tokens in ((30, 149), (18, 617), (7, 4000), (26, 33)):
        for step in range(1, tokens, max(1, tokens // 9)):
            kept = [(tokens - (i * step) % tokens) for i in range(layers)]
            stats = KVStats(kept, [tokens - k for k in kept], tokens)
            # exactly: 1 - kept / full - ratio in floats leaves ~1e-16 in many of these
            assert stats.window_ratio == 0.0, (layers, tokens, step)


def test_window_ratio_counts_what_neither_kept_nor_compression_removed():
    # Gemma-like: 4 layers of 1000 tokens, one global layer compressed to 400, three local
    # layers holding a 512-token window and nothing evicted by compression.
    stats = KVStats([400, 512, 512, 512], [600, 0, 0, 0], 1000)
    assert stats.compression_ratio == 600 / 4000
    assert stats.window_ratio == 3 * 488 / 4000
    assert KVStats([], [], 0).window_ratio == 0.0


def test_generate_json_rows_carry_every_usage_figure():
    # `sparsekv generate --json` prints these rows: the server's usage fields, same values.
    from sparsekv.distributed.batch import output_row
    from sparsekv.outputs import CompletionOutput, RequestOutput

    stats = KVStats([400, 512, 512, 512], [600, 0, 0, 0], 1000)
    done = CompletionOutput(0, "hi", [5, 6], "length")
    row = output_row("p", RequestOutput("r", [1, 2], [done], True, stats))
    assert row == {
        "prompt": "p",
        "text": "hi",
        "token_ids": [5, 6],
        "finish_reason": "length",
        "kv_tokens_kept": 484.0,
        "kv_tokens_full": 1000,
        "kv_compression_ratio": 0.15,
        "kv_sliding_window_ratio": 0.366,
        "cached_tokens": 0,
    }
