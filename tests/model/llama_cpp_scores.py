"""Teacher-forced logits from llama.cpp (``llama_cpp``), computed in a child process.

llama.cpp is an independent check of our GGUF loading, but its prebuilt wheel crashes the whole
interpreter with SIGSEGV on some CPUs (seen on an AMX-capable Sapphire Rapids VM, where its AMX
path faults). Running it in a subprocess turns such a crash into a skip instead of killing the
pytest session.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

_CHILD = """
import json, sys
import numpy as np
import llama_cpp
args = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=args["model"], n_ctx=128, logits_all=True, verbose=False,
                      n_threads=1)
llm.eval(args["tokens"])
np.save(args["out"], np.array(llm.scores[: len(args["tokens"])], dtype=np.float32))
"""


def llama_cpp_scores(model_path: Path, token_ids: list[int], tmp_path: Path) -> np.ndarray:
    """``[len(token_ids), vocab]`` fp32 logits of llama.cpp evaluating ``token_ids``.

    Skips the calling test when ``llama_cpp`` is not installed or crashes on this CPU.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama_cpp is not installed")
    out = tmp_path / "llama_cpp_scores.npy"
    args = json.dumps({"model": str(model_path), "tokens": list(token_ids), "out": str(out)})
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, args], capture_output=True, text=True, timeout=600
    )
    if done.returncode < 0:
        pytest.skip(f"llama_cpp crashed on this CPU (signal {-done.returncode})")
    assert done.returncode == 0, done.stderr[-2000:]
    return np.load(out)
