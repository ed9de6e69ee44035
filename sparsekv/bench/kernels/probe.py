"""The machine probe, the timer and the printed row shared by every kernel of the bench."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from sparsekv.attention.cpu import build, ops

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``fn`` in seconds over ``repeats`` runs, after one warm-up."""
    return timed(fn, repeats)[0]


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best wall seconds, process CPU seconds per intra-op thread of that run) of ``fn``.

    On a machine shared with other work the CPU time per thread estimates the uncontended wall
    time (an upper bound: stalls on memory that others contend for count too).
    """
    fn()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        cpu, start = time.process_time(), time.perf_counter()
        fn()
        wall = time.perf_counter() - start
        if wall < best:
            best, best_cpu = wall, (time.process_time() - cpu) / torch.get_num_threads()
    return best, best_cpu


def measure_machine(repeats: int) -> dict:
    """Read bandwidth (bytes/s, fp32 sum of 512 MiB) and matmul FLOP/s per dtype."""
    data = torch.ones(128 * 1024 * 1024)
    read_bw = data.numel() * 4 / best_time(data.sum, repeats)
    del data
    flops = {}
    for name, dtype in DTYPES.items():
        n = 1024
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        flops[name] = 2 * n**3 / best_time(lambda a=a, b=b: a @ b, repeats)
    return {"read_bandwidth": read_bw, "matmul_flops": flops}


def native_isa(args: argparse.Namespace, quantized: bool = False) -> str | None:
    """The kernel variant to time: ``--isa`` (checked against this CPU) or the default pick
    (for int8 / fp8 pages: ``quantized``).

    Raises:
        ValueError: ``--isa`` names a variant this CPU does not run.
    """
    if args.isa is not None and args.isa not in ops.available_isas():
        raise ValueError(
            f"--isa {args.isa!r} is not a kernel variant this CPU runs: {ops.available_isas()}"
        )
    return args.isa or ops.pick_isa(args.head_dim, quantized)


def row(name: str, times: tuple[float, float], bound: float, note: str) -> dict:
    """Print one timed row beside its bound (seconds; ``note`` says what bounds it) and return
    it as the report's dict (``name``, ``ms``, ``cpu_ms_per_thread``, ``bound_ms``, ``ratio``)."""
    seconds, cpu = times
    print(
        f"{name:<46} {seconds * 1e3:9.3f} ms (cpu/thread {cpu * 1e3:8.3f})  "
        f"bound {bound * 1e3:8.3f} ms ({note})  x{seconds / bound:5.2f}"
    )
    return {
        "name": name,
        "ms": seconds * 1e3,
        "cpu_ms_per_thread": cpu * 1e3,
        "bound_ms": bound * 1e3,
        "ratio": seconds / bound,
    }


def native_and_reference_rows(
    args: argparse.Namespace,
    names: tuple[str, str],
    make: Callable[[Callable], Callable[[], object]],
    native_op: Callable,
    reference: Callable,
    bound: float,
    note: str,
    reference_repeats: int | None = None,
) -> list[dict]:
    """The native kernel's row (when the extension is built; ``native_op`` at
    :func:`native_isa`) and the reference's (unless ``--no-reference``) for one case:
    ``make(fn)`` is the timed call of ``fn``, ``names`` the two row names,
    ``reference_repeats`` the reference's repeats (default ``--repeats``)."""
    rows = []
    if build.load_extension() is not None:
        native = functools.partial(native_op, isa=native_isa(args))
        rows.append(row(names[0], timed(make(native), args.repeats), bound, note))
    if not args.no_reference:
        repeats = args.repeats if reference_repeats is None else reference_repeats
        rows.append(row(names[1], timed(make(reference), repeats), bound, note))
    return rows
