"""Teacher-forced logits from llama.cpp (``llama_cpp``), computed in a child process.

llama.cpp is an independent check of our GGUF loading, but a llama-cpp-python built for an AMX CPU
dies on a signal on some of them (SIGILL on an Emerald Rapids VM, at a tile instruction of its AMX
matmuls, an "extra buffer type" that repacks the weights). It runs in a subprocess, so a crash
cannot kill the pytest session; after one, the evaluation is repeated with llama.cpp's extra buffer
types off (its plain CPU matmuls, the same products), and only a second crash skips the test.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

_CHILD = """
import json, sys
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as low
args = json.loads(sys.argv[1])
if not args["extra_buffer_types"]:
    defaults = low.llama_model_default_params
    def plain_params():
        params = defaults()
        params.use_extra_bufts = False
        return params
    low.llama_model_default_params = plain_params
llm = llama_cpp.Llama(model_path=args["model"], n_ctx=128, logits_all=True, verbose=False,
                      n_threads=1)
llm.eval(args["tokens"])
np.save(args["out"], np.array(llm.scores[: len(args["tokens"])], dtype=np.float32))
"""


def llama_cpp_scores(model_path: Path, token_ids: list[int], tmp_path: Path) -> np.ndarray:
    """``[len(token_ids), vocab]`` fp32 logits of llama.cpp evaluating ``token_ids``.

    Skips the calling test when ``llama_cpp`` is not installed, or crashes on this CPU with and
    without its extra buffer types.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama_cpp is not installed")
    out = tmp_path / "llama_cpp_scores.npy"
    args = {"model": str(model_path), "tokens": list(token_ids), "out": str(out)}
    signals = []  # of the runs a signal killed
    for extra_buffer_types in (True, False):
        child_args = json.dumps({**args, "extra_buffer_types": extra_buffer_types})
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, child_args],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode >= 0:
            break
        signals.append(-done.returncode)
    if len(signals) == 2:
        pytest.skip(f"llama_cpp crashed on this CPU with and without extra buffers ({signals})")
    if signals:
        warnings.warn(
            f"llama_cpp died with signal {signals[0]} on this CPU; the reference ran with its "
            "extra buffer types off",
            stacklevel=2,
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return np.load(out)
