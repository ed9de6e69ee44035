"""Run one of the GPU check's scripts as the GPU machine would: a fresh interpreter in which the
packages that machine lacks (gguf, the server stack, matplotlib) cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABSENT = ("gguf", "fastapi", "pydantic", "uvicorn", "prometheus_client", "httpx", "matplotlib")


def run_gpu_script(name: str, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """``scripts/<name> args...`` with :data:`ABSENT` blocked; output captured as text."""
    script = ROOT / "scripts" / name
    runner = (
        "import runpy, sys\n"
        f"for name in {ABSENT!r}: sys.modules[name] = None\n"
        f"sys.argv = [{name!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", runner, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
