"""``sparsekv bench spec-decode`` with ``sparse_self`` and long prompts on a tiny random Llama
(no timing asserts), and the bytes-read arithmetic of ``bench.spec_bytes``."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv.bench import spec_bytes, spec_decode
from tests.conftest import tiny_checkpoint, tiny_llama_config


@pytest.fixture(autouse=True)
def restore_threads():
    """The command runs with ``--threads 1``; give the session its count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_step_figures():
    # W = 100 MB, s = 1 kB per slot, C = 10000 slots, V = 1000, B = 2, K = 4, L = 2.5.
    figures = spec_bytes.step_figures(100e6, 1000, 10_000, 2, 4, 1000, 2.5, 10e9)
    assert figures["target_step_mb"] == pytest.approx(120.0)
    assert figures["draft_step_mb"] == pytest.approx(102.0)
    assert figures["plain_bytes_per_token_mb"] == pytest.approx(60.0)
    assert figures["plain_bound_tok_s"] == pytest.approx(10e9 * 2 / 120e6)
    assert figures["self_bytes_per_token_mb"] == pytest.approx((4 * 102 + 120) / 5)
    assert figures["self_bound_tok_s"] == pytest.approx(10e9 * 5 / 528e6)
    assert spec_bytes.step_figures(1, 1, 1, 1, 4, 1, None, 1.0)["self_bound_tok_s"] is None
    # a draft reading 70 MB of the weights (a reduced vocabulary's share of the head)
    narrow = spec_bytes.step_figures(100e6, 1000, 10_000, 2, 4, 1000, 2.5, 10e9, 70e6)
    assert narrow["draft_step_mb"] == pytest.approx(72.0)
    assert narrow["target_step_mb"] == pytest.approx(120.0)


def test_draft_weight_bytes_leave_out_the_head_rows_past_the_vocabulary():
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(8, 1000, bias=False)  # 32000 bytes of fp32 rows
    assert spec_bytes.draft_weight_bytes(model, 50_000, 250, 1) == 50_000 - 24_000
    assert spec_bytes.draft_weight_bytes(model, 50_000, None, 1) == 50_000
    assert spec_bytes.draft_weight_bytes(model, 50_000, 1000, 1) == 50_000
    # a head that computes every row (a vocabulary-parallel one gathers in a hook) saves none
    model.lm_head.register_forward_hook(lambda module, inputs, output: output)
    assert spec_bytes.draft_weight_bytes(model, 50_000, 250, 1) == 50_000


def test_view_slots():
    assert spec_bytes.view_slots(7000, 16, 64, 448) == 64 + 448 + 16
    assert spec_bytes.view_slots(300, 16, 64, 448) == 300
    assert spec_bytes.view_slots(7000, 16, 10, 0) == 32


def test_sparse_self_rows_with_long_prompts(tmp_path, smollm2_tokenizer):
    checkpoint = tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=11)[0]
    out = tmp_path / "spec.json"
    argv = [
        *("--dtype", "float32", "--threads", "1", "--kv-cache-memory", "0.05"),
        *("--kv-compression", "none", "--batch-sizes", "2", "--output-len", "6"),
        *("--speculative-method", "sparse_self", "--num-speculative-tokens", "3"),
        *("--speculative-draft-sink-tokens", "16", "--speculative-draft-recent-tokens", "32"),
        *("--speculative-draft-vocab-size", "4096"),
        *("--prompt-tokens", "400", "--read-bandwidth", "20", "--no-warmup"),
        *("--output", str(out)),
    ]
    assert spec_decode.main(argv, checkpoint=checkpoint) == 0
    document = json.loads(out.read_text())
    plain, spec = document["rows"]
    assert (plain["system"], spec["system"]) == ("plain", "sparse_self")
    assert spec["same_tokens"] == "2/2" and spec["mean_accepted_length"] >= 1
    # three draft forwards and one verifying forward per step, timed apart
    assert spec["draft_ms_per_step"] > 0 and spec["verify_ms_per_step"] > 0
    assert document["read_bandwidth"] == 20e9
    assert 350 < plain["context_slots"] < 500 and spec["view_slots"] == 16 + 32 + 16
    assert spec["draft_step_mb"] < spec["target_step_mb"] == plain["target_step_mb"]
    # the head (49152 x 64 fp32, 12.6 MB) is most of the weights; the draft reads 4096 rows
    assert spec["draft_step_mb"] < 0.25 * spec["target_step_mb"]
    assert plain["self_bound_tok_s"] is None and spec["self_bound_tok_s"] > 0
