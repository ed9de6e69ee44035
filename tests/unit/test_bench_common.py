"""Bench helpers and the ``sparsekv bench`` dispatcher (no model needed except the last test)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sparsekv.bench import common
from sparsekv.bench import main as bench_main
from tests.conftest import tiny_checkpoint, tiny_llama_config


@pytest.fixture(autouse=True)
def restore_threads():
    """The commands run with ``--threads 1`` (tiny ops); give the session its count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_random_prompts_exact_lengths_fixed_seed_and_avoided_ids():
    prompts = common.random_prompts(3, 50, vocab_size=20, seed=4, avoid=[0, 1, 2])
    assert [len(p) for p in prompts] == [50, 50, 50]
    assert all(3 <= t < 20 for p in prompts for t in p)
    assert prompts == common.random_prompts(3, 50, vocab_size=20, seed=4, avoid=[0, 1, 2])
    assert prompts != common.random_prompts(3, 50, vocab_size=20, seed=5, avoid=[0, 1, 2])


def test_percentile_interpolates_and_handles_empty():
    assert common.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert common.percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert common.percentile([5.0], 90) == 5.0
    assert math.isnan(common.percentile([], 50))


def test_format_table_aligns_columns():
    text = common.format_table([{"a": 1.23456, "b": "x"}, {"a": 10, "b": None}], ["a", "b"])
    lines = text.splitlines()
    assert len(lines) == 4 and "1.235" in lines[2]
    assert len({len(line) for line in lines}) == 1


def test_dispatcher_usage_unknown_and_unavailable(capsys, monkeypatch):
    assert bench_main.main([]) == 2
    assert bench_main.main(["--help"]) == 0
    assert "throughput" in capsys.readouterr().out
    assert bench_main.main(["no-such-bench"]) == 2
    monkeypatch.setitem(bench_main.COMMANDS, "later", ("sparsekv.bench._not_written", "x"))
    assert bench_main.main(["later"]) == 2
    assert "not available" in capsys.readouterr().err


def test_dispatcher_passes_arguments_and_checkpoint(tmp_path, smollm2_tokenizer):
    checkpoint, _ = tiny_checkpoint(tiny_llama_config(num_layers=2), smollm2_tokenizer, seed=3)
    out = tmp_path / "tp.json"
    argv = ["throughput", "--input-len", "12", "--output-len", "3", "--num-prompts", "2"]
    argv += [
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--kv-cache-memory",
        "0.02",
        "--output",
        str(out),
    ]
    assert bench_main.main(argv, checkpoint=checkpoint) == 0
    document = json.loads(out.read_text())
    assert document["batch"]["output_tokens"] == 6
    assert document["provenance"]["load_average_start"] is not None
