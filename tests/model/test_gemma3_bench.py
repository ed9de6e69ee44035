"""``sparsekv bench gemma-paging`` end to end on a tiny random Gemma 3 (a smoke test, not a
measurement: benchmarks are commands with reports, never timed tests)."""

from __future__ import annotations

import json

import torch

from sparsekv.bench import gemma_paging
from tests.model.test_gemma3 import WINDOW, checkpoint_of, random_hf_model, tiny_config


def test_gemma_paging_bench_reports_both_modes(tmp_path, capsys):
    checkpoint = checkpoint_of(random_hf_model(tiny_config()))
    output = tmp_path / "gemma_paging.json"
    argv = ["--num-requests", "3", "--input-len", "60", "--output-len", "12"]
    argv += ["--block-size", "4", "--max-num-batched-tokens", "32", "--dtype", "float32"]
    argv += ["--passkey-length", "200"]  # mechanics only: a random model finds nothing
    threads = torch.get_num_threads()
    try:
        status = gemma_paging.main(
            argv + ["--threads", "1", "--output", str(output)], checkpoint=checkpoint
        )
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    report = json.loads(output.read_text())
    assert report["same_outputs"] is True
    aware, full = report["runs"]["sliding-aware"], report["runs"]["all-full"]
    assert aware["num_preemptions"] == full["num_preemptions"] == 0
    assert full["peak_pages_global"] == aware["peak_pages_global"]
    # 3 local layers x 3 requests: at most window + one step's tokens + one page each.
    assert aware["peak_pages_local"] <= 3 * 3 * -(-(WINDOW + 32 + 4) // 4)
    assert full["peak_pages_local"] > aware["peak_pages_local"]
    full_pk, snapkv_pk = report["passkey"]
    assert (full_pk["policy"], snapkv_pk["policy"]) == ("full", "snapkv-75%-removed")
    # SnapKV compresses the global layers (2 and 4) only; local layers keep their window.
    assert snapkv_pk["kept_per_layer"][2] < full_pk["kept_per_layer"][2] / 3
    assert snapkv_pk["kept_per_layer"][0] == full_pk["kept_per_layer"][0] <= WINDOW + 4
    assert (tmp_path / "gemma_paging.md").exists()
    assert "sliding-aware" in capsys.readouterr().out
