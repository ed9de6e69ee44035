"""The GPU check's graph-vs-eager engine comparison (``scripts/gpu_check_graphs.py``) on the
CPU: the static-buffer decode path runs eagerly there, so the script must report the same
tokens and kept slots as the eager engine for both policies, with the packages the GPU machine
lacks made unimportable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check_graphs.py"
ABSENT = ("gguf", "fastapi", "pydantic", "uvicorn", "prometheus_client", "httpx", "matplotlib")
RUNNER = (
    "import runpy, sys\n"
    f"for name in {ABSENT!r}: sys.modules[name] = None\n"
    "sys.argv = ['gpu_check_graphs.py', *sys.argv[1:]]\n"
    f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
)


@pytest.mark.slow
def test_cpu_quick_run_passes_for_both_policies(tmp_path):
    out = tmp_path / "graphs.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, "--device", "cpu", "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert [case["policy"] for case in cases] == ["none", "snapkv"]
    for case in cases:
        assert case["same_tokens"] and case["same_kept"] and case["pass"], case
        assert case["max_logit_diff"] <= 1e-5 and case["graphs_captured"] == []
    assert cases[1]["kept_selections"] > 0  # SnapKV did select
    assert "PASS" in result.stdout
