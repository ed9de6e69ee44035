"""``sparsekv bench roofline`` on a tiny random Llama, with a fixed machine probe."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv.bench import kernels, roofline
from tests.conftest import tiny_checkpoint, tiny_llama_config

MACHINE = {"read_bandwidth": 1e10, "matmul_flops": {"fp32": 1e11, "bf16": 1e10}}


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_roofline_rows_and_bounds(tmp_path, smollm2_tokenizer, monkeypatch):
    monkeypatch.setattr(kernels, "measure_machine", lambda repeats: MACHINE)
    checkpoint, _ = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=5)
    out = tmp_path / "roofline.json"
    argv = ["--batch", "1", "2", "--context", "40", "--steps", "3", "--kv-compression", "none"]
    argv += ["--dtype", "float32", "--threads", "1", "--kv-cache-memory", "0.05"]
    argv += ["--output", str(out)]
    assert roofline.main(argv, checkpoint=checkpoint) == 0
    document = json.loads(out.read_text())
    # hidden 64, 4 heads x 16, 2 KV heads, MLP 128, 3 layers, untied head over 49152 tokens.
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 128 + 128 * 64 + 2 * 64
    model = document["model"]
    assert model["body_params"] == 3 * per_layer + 64
    assert model["head_params"] == 49152 * 64
    assert model["weight_bytes"] == 4 * (model["body_params"] + model["head_params"])
    rows = {row["batch"]: row for row in document["rows"]}
    assert set(rows) == {1, 2}
    for batch, row in rows.items():
        # Before the timed steps each request holds 41..43 slots in each of 3 layers (the
        # newest token is written by the step that reads it).
        slots = row["decode_kv_mb"] * 1e6 / (2 * 2 * 16 * 4)
        assert 3 * 41 * batch <= slots <= 3 * 43 * batch
        weight_s = model["weight_bytes"] / MACHINE["read_bandwidth"]
        assert row["decode_bound_ms"] >= 1000 * weight_s
        assert row["decode_fraction"] > 0 and row["prefill_fraction"] > 0
        assert row["prefill_bound_s"] == pytest.approx(
            batch * (2 * model["body_params"] * 40 + 2 * 3 * 4 * 16 * 40 * 41
                     + 2 * model["head_params"]) / 1e11
        )  # fmt: skip


def test_roofline_keeps_the_whole_batch_running(tmp_path, smollm2_tokenizer, monkeypatch):
    """Prefill over several steps (requests prefilled first decode meanwhile): every request
    still runs, and holds its prompt's slots, in every timed step."""
    monkeypatch.setattr(kernels, "measure_machine", lambda repeats: MACHINE)
    checkpoint, _ = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=5)
    out = tmp_path / "roofline.json"
    argv = ["--batch", "4", "--context", "40", "--steps", "3", "--kv-compression", "none"]
    argv += ["--dtype", "float32", "--threads", "1", "--kv-cache-memory", "0.05"]
    argv += ["--max-num-batched-tokens", "40", "--output", str(out)]
    assert roofline.main(argv, checkpoint=checkpoint) == 0
    (row,) = json.loads(out.read_text())["rows"]
    slots = row["decode_kv_mb"] * 1e6 / (2 * 2 * 16 * 4)
    # 4 prefill steps: the first request has decoded 3 tokens more than the last one.
    assert 3 * 4 * 41 <= slots <= 3 * (4 * 43 + 3 + 2 + 1)
