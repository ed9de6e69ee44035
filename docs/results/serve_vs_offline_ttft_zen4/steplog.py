"""Run ``sparsekv <args>`` with every engine step over 50 ms timed on stderr (wall and the
engine thread's CPU time), to split a TTFT into the prefill step and everything around it."""

import sys
import threading
import time

from sparsekv.cli import main
from sparsekv.engine import llm_engine

untimed_step = llm_engine.LLMEngine.step


def timed_step(self):
    wall, cpu = time.perf_counter(), time.thread_time()
    out = untimed_step(self)
    elapsed = time.perf_counter() - wall
    if elapsed > 0.05:
        used = time.thread_time() - cpu
        name = threading.current_thread().name
        print(f"STEP {elapsed:.3f}s cpu(thread) {used:.3f} thread={name}", file=sys.stderr, flush=True)
    return out


llm_engine.LLMEngine.step = timed_step
sys.argv = ["sparsekv", *sys.argv[1:]]
sys.exit(main())
