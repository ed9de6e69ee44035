"""``sparsekv bench SUBCOMMAND ...``: dispatch to the benchmark commands.

Each subcommand lives in its own module with a ``main(argv)`` function, imported only when
asked for, so one command's heavy or missing dependencies never break another.
"""

from __future__ import annotations

import importlib
import sys

# Subcommand -> (module, one-line help). Modules not written yet answer "not available".
COMMANDS: dict[str, tuple[str, str]] = {
    "throughput": ("sparsekv.bench.throughput", "offline throughput of a random-token batch"),
    "compression": ("sparsekv.bench.compression", "full cache vs compressed under a small pool"),
    "fidelity": ("sparsekv.bench.fidelity", "greedy agreement and KL vs the full cache"),
    "kv-quant": (
        "sparsekv.bench.kv_quant",
        "KV formats (int8, fp8, int4): memory, speed, fidelity",
    ),
    "kernels": ("sparsekv.bench.kernels", "attention kernel timings"),
    "gemma-paging": ("sparsekv.bench.gemma_paging", "Gemma 3 sliding-window paging"),
    "serve": ("sparsekv.bench.serve", "load generator against an OpenAI-compatible server"),
    "sweep": ("sparsekv.bench.sweep", "serving sweep over concurrency levels"),
    "roofline": ("sparsekv.bench.roofline", "decode step time vs its bandwidth bound"),
    "decode-compare": (
        "sparsekv.bench.decode_compare",
        "batch-1 decode vs llama.cpp's llama-bench on the same GGUF",
    ),
    "spec-decode": (
        "sparsekv.bench.spec_decode",
        "speculative decoding vs plain decoding on code-editing prompts",
    ),
}


def usage() -> str:
    """The list of subcommands, one per line."""
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name.ljust(width)}  {text}" for name, (_, text) in COMMANDS.items()]
    return "usage: sparsekv bench SUBCOMMAND [flags]\n\nsubcommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None, **kwargs) -> int:
    """Run ``argv[0]``'s ``main(argv[1:], **kwargs)``; return its exit status.

    Args:
        argv: subcommand and its flags (default: ``sys.argv[1:]``).
        **kwargs: passed to the subcommand (tests inject ``checkpoint=``).

    Returns:
        0 on success, 2 for an unknown or unavailable subcommand.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown bench subcommand {name!r}\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the command exists but one of its own imports is missing
        print(f"error: bench {name} is not available in this build", file=sys.stderr)
        return 2
    status = module.main(rest, **kwargs)
    return int(status or 0)
