"""The GPU check's graph-vs-eager engine comparison (``scripts/gpu_check_graphs.py``) on the
CPU: the static-buffer decode path runs eagerly there, so the script must report the same
tokens and kept slots as the eager engine for both policies, with the packages the GPU machine
lacks made unimportable."""

from __future__ import annotations

import json

import pytest

from tests.gpu_scripts import run_gpu_script


@pytest.mark.slow
def test_cpu_quick_run_passes_for_both_policies(tmp_path):
    out = tmp_path / "graphs.json"
    result = run_gpu_script("gpu_check_graphs.py", "--device", "cpu", "--quick", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert [case["policy"] for case in cases] == ["none", "snapkv"]
    for case in cases:
        assert case["same_tokens"] and case["same_kept"] and case["pass"], case
        assert case["max_logit_diff"] <= 1e-5 and case["graphs_captured"] == []
    assert cases[1]["kept_selections"] > 0  # SnapKV did select
    assert "PASS" in result.stdout
