"""``sparsekv bench spec-decode`` end to end on a tiny random Llama (no timing asserts)."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv.bench import spec_decode
from tests.conftest import tiny_checkpoint, tiny_llama_config


@pytest.fixture(autouse=True)
def restore_threads():
    """The command runs with ``--threads 1``; give the session its count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_plain_and_ngram_rows_per_batch_size(tmp_path, smollm2_tokenizer):
    checkpoint = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=11)[0]
    out = tmp_path / "spec.json"
    argv = [
        *("--dtype", "float32", "--threads", "1", "--kv-cache-memory", "0.05"),
        *("--kv-compression", "none", "--batch-sizes", "1,2", "--output-len", "6"),
        *("--no-warmup", "--output", str(out)),
    ]
    assert spec_decode.main(argv, checkpoint=checkpoint) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["batch_size"]) for r in rows] == [
        ("plain", 1),
        ("ngram", 1),
        ("plain", 2),
        ("ngram", 2),
    ]
    assert all(r["output_tokens"] == 6 * r["batch_size"] for r in rows)
    assert rows[0]["mean_accepted_length"] is None  # the plain run drafts nothing
    assert all(r["same_tokens"] == f"{r['batch_size']}/{r['batch_size']}" for r in rows[1::2])
    assert (tmp_path / "spec.md").read_text().startswith("# Speculative decoding")


def test_bad_batch_sizes_raise(tmp_path, smollm2_tokenizer):
    checkpoint = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=11)[0]
    argv = ["--batch-sizes", "0", "--output", str(tmp_path / "x.json"), "--no-warmup"]
    with pytest.raises(ValueError, match="batch_sizes"):
        spec_decode.main(argv, checkpoint=checkpoint)
