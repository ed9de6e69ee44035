"""Provenance of a measurement: code version, library versions, threads, CPU."""

from __future__ import annotations

import datetime
import functools
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

# Flags that decide which kernels and dtypes are fast on this CPU (``--dtype auto`` reads them).
CPU_FLAGS_OF_INTEREST = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
    "amx_tile",
)
# Intel family 6 server models, by the model number Intel's SDM lists (a cloud VM's model name is
# often just "Intel(R) Xeon(R) Processor"): the CPU classes this project's figures are taken on.
_INTEL_SERVER_MODELS = {
    85: "Skylake / Cascade Lake / Cooper Lake",
    106: "Ice Lake",
    143: "Sapphire Rapids",
    207: "Emerald Rapids",
    173: "Granite Rapids",
}

_REPO_ROOT = Path(__file__).resolve().parents[2]


def _git(*args: str, root: Path | None = None) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=root or _REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def _code_version(root: Path) -> tuple[str | None, bool | None]:
    status = _git("status", "--porcelain", root=root)
    return _git("rev-parse", "HEAD", root=root), None if status is None else bool(status)


def code_version() -> tuple[str | None, bool | None]:
    """``(git SHA, dirty)`` of the checkout as it was when this process first asked (``None``
    outside a git checkout). ``sparsekv bench`` and ``sparsekv eval`` ask when they start, so the
    report of a long run names the code the run imported, not a tree edited while it ran."""
    return _code_version(_REPO_ROOT)


def cpu_info(path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """CPU model name, vendor, family and model numbers, the core generation where known (AMD
    Zen 4 / Zen 5, Intel Xeon Skylake to Granite Rapids), and the flags of
    :data:`CPU_FLAGS_OF_INTEREST` (``False`` when unknown).

    Reads Linux's ``/proc/cpuinfo``; elsewhere the model is ``platform.processor()``, the
    numbers are ``None`` and no flag is set.
    """
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first CPU's entry
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    model = fields.get("model name") or platform.processor() or None
    family, number = _int_field(fields, "cpu family"), _int_field(fields, "model")
    vendor = fields.get("vendor_id") or None
    return {
        "model": model,
        "vendor": vendor,
        "family": family,
        "model_number": number,
        "generation": _generation(vendor, family, number, "avx512f" in flags),
        "flags": {name: name in flags for name in CPU_FLAGS_OF_INTEREST},
    }


def _int_field(fields: dict[str, str], key: str) -> int | None:
    value = fields.get(key, "")
    return int(value) if value.isdigit() else None


def _generation(
    vendor: str | None, family: int | None, model: int | None, avx512: bool
) -> str | None:
    if vendor == "GenuineIntel":
        return _INTEL_SERVER_MODELS.get(model) if family == 6 else None
    if vendor != "AuthenticAMD":
        return None
    # AMD families (the model name of a cloud VM is often just "AMD EPYC"): 25 (0x19) with
    # AVX-512 is Zen 4 (Zen 3 has none), 26 (0x1A) is Zen 5.
    if family == 26:
        return "Zen 5"
    if family == 25 and avx512:
        return "Zen 4"
    return None


def command_line(argv: list[str] | None = None) -> str | None:
    """The running command as a user types it: ``sparsekv ...`` for the command-line tool
    (console script or ``python -m sparsekv``), else the program and its arguments; ``None``
    without one (an interactive interpreter). ``argv`` defaults to ``sys.argv``."""
    argv = sys.argv if argv is None else argv
    if not argv or not argv[0] or argv[0] == "-c":
        return None
    program = Path(argv[0])
    args = _redacted(argv[1:])
    if program.name == "sparsekv" or program.parts[-2:] == ("sparsekv", "__main__.py"):
        return shlex.join(["sparsekv", *args])
    return shlex.join([program.name, *args])


_SECRET_ENDINGS = ("key", "-token", "secret", "password")


def _redacted(args: list[str]) -> list[str]:
    """``args`` with the value of every option named like a secret (``--api-key V``,
    ``--hf-token=V``) replaced by ``***`` (``--max-tokens`` is none)."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append("***")
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        secret = name.startswith("--") and name.lower().endswith(_SECRET_ENDINGS)
        if secret and eq:
            out.append(f"{name}=***")
        else:
            out.append(arg)
            hide_next = secret
    return out


def provenance(config: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a report needs to be reproduced.

    Args:
        config: the settings of the measurement (model, dtype, policy...), stored as given.

    Returns:
        A JSON-ready dict with ``git_sha`` and ``git_dirty`` (:func:`code_version`),
        ``torch_version``, ``transformers_version`` (``None`` if not installed),
        ``num_threads`` (``torch.get_num_threads()``), ``cpu`` (model name and flags
        avx2/avx512f/avx512_bf16/amx_bf16/amx_tile), ``python_version``, ``platform``,
        ``date`` (UTC, ISO 8601), ``config``, ``command`` (:func:`command_line`) and
        ``environment`` (:func:`kernel_environment`).
    """
    try:
        import transformers

        transformers_version: str | None = transformers.__version__
    except ImportError:
        transformers_version = None
    sha, dirty = code_version()
    return {
        "git_sha": sha,
        "git_dirty": dirty,
        "torch_version": torch.__version__,
        "transformers_version": transformers_version,
        "num_threads": torch.get_num_threads(),
        "cpu": cpu_info(),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": dict(config) if config is not None else None,
        "command": command_line(),
        "environment": kernel_environment(),
    }


# Variables that change which kernels a run uses (ISA limits of PyTorch, oneDNN and MKL, and
# sparsekv's own switches, ``SPARSEKV_*``): a report records the ones set.
KERNEL_ENV_PREFIXES = ("SPARSEKV_", "ATEN_CPU_CAPABILITY", "ONEDNN_", "DNNL_", "MKL_ENABLE")


SECRET_NAME_PARTS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def kernel_environment() -> dict[str, str]:
    """The set environment variables among :data:`KERNEL_ENV_PREFIXES` (name -> value), sorted;
    e.g. ``{"ONEDNN_MAX_CPU_ISA": "AVX2", "SPARSEKV_KERNEL_ISA": "avx2"}`` for a run that
    emulates an AVX2-only CPU. Values of names holding one of :data:`SECRET_NAME_PARTS`
    (``SPARSEKV_API_KEY``) read ``"<hidden>"``."""
    return {
        name: "<hidden>" if any(part in name for part in SECRET_NAME_PARTS) else value
        for name, value in sorted(os.environ.items())
        if name.startswith(KERNEL_ENV_PREFIXES)
    }
