"""``sparsekv env``: what sparsekv will do on this machine, for a first look or a bug report.

Versions (sparsekv, Python, torch with its CUDA devices, transformers, triton), the CPU as
reports describe it (``evaluation.provenance.cpu_info``), the native kernel variants as
``sparsekv bench kernels --list`` prints them (``bench.kernels.variants.variant_lines``), the
cache folders with the variable that moves each, and the behaviour-changing environment
variables set now. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
from typing import Any

import torch

# Set variables a report names besides provenance.kernel_environment's (SPARSEKV_*,
# ATEN_CPU_CAPABILITY, ONEDNN_*, DNNL_*, MKL_ENABLE*): the OpenMP pool size.
EXTRA_ENV = ("OMP_NUM_THREADS",)
BUILD_NOTICE = "building native kernels (first use only, about 1-3 min on 2 cores)..."


def versions() -> dict[str, Any]:
    """Returns ``{"sparsekv", "python", "torch", "transformers", "triton"}`` version strings
    (``None`` for transformers / triton where they do not import) and ``"cuda"``:
    ``{"available": bool, "version": torch's CUDA version or None, "devices": [names]}``."""
    import sparsekv

    available = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "sparsekv": sparsekv.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": {"available": available, "version": torch.version.cuda, "devices": devices},
        "transformers": _module_version("transformers"),
        "triton": _module_version("triton"),
    }


def _module_version(name: str) -> str | None:
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - optional: a broken install reads as absent
        return None
    return str(getattr(module, "__version__", "unknown"))


def cpu() -> dict[str, Any]:
    """Returns :func:`~sparsekv.evaluation.provenance.cpu_info` (``model``, ``vendor``,
    ``family``, ``model_number``, ``generation``, ``flags``: name -> bool) plus ``cores``
    (``os.cpu_count()``), ``usable_cores`` (this process's CPU affinity, else ``cores``) and
    ``torch_threads`` (``torch.get_num_threads()``, the intra-op pool)."""
    from sparsekv.evaluation.provenance import cpu_info

    info = cpu_info()
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return {
        **info,
        "cores": cores,
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
    }


def native_extensions() -> list[dict[str, Any]]:
    """Returns one ``{"name", "directory", "built", "disabled"}`` per native extension
    (attention kernels, fused ops, packed weights): its build folder under the extension cache,
    whether the library is there now, and whether ``SPARSEKV_DISABLE_*`` turns it off."""
    from sparsekv.attention.cpu import build as attention_build
    from sparsekv.models.fused import build as fused_build
    from sparsekv.models.quant import build as quant_build

    disabled = attention_build.native_disabled()
    rows = []
    for module, off in (
        (attention_build, disabled),
        (fused_build, fused_build.fused_disabled()),
        (quant_build, disabled),
    ):
        directory = module.build_directory()
        built = (directory / f"{module.EXTENSION_NAME}.so").exists()
        rows.append(
            {"name": module.EXTENSION_NAME, "directory": str(directory), "built": built,
             "disabled": off}
        )  # fmt: skip
    return rows


def caches() -> dict[str, dict[str, str]]:
    """Returns ``{"native_kernels", "loader", "ruler_data"}``, each ``{"path", "env"}``: the
    folder sparsekv uses and the environment variable that moves it (the RULER data and,
    unless ``SPARSEKV_EXT_DIR`` is set, the native kernels live under the loader's root, so
    ``SPARSEKV_CACHE_DIR`` moves them too; the deprecated ``SPARSEKV_CACHE`` still wins for
    the RULER data where set)."""
    from sparsekv.attention.cpu.build import build_directory
    from sparsekv.evaluation import ruler_data
    from sparsekv.loader.cache import cache_root

    return {
        "native_kernels": {"path": str(build_directory().parent), "env": "SPARSEKV_EXT_DIR"},
        "loader": {"path": str(cache_root()), "env": "SPARSEKV_CACHE_DIR"},
        "ruler_data": {"path": str(ruler_data.cache_dir()), "env": "SPARSEKV_CACHE_DIR"},
    }


def environment() -> dict[str, str]:
    """Returns the behaviour-changing variables set now, name -> value, sorted: those of
    :func:`~sparsekv.evaluation.provenance.kernel_environment` (secrets read ``<hidden>``) and
    :data:`EXTRA_ENV`."""
    from sparsekv.evaluation.provenance import kernel_environment

    found = kernel_environment()
    found.update({name: os.environ[name] for name in EXTRA_ENV if name in os.environ})
    return dict(sorted(found.items()))


def report() -> dict[str, Any]:
    """Returns the whole report: ``versions``, ``cpu``, ``kernels`` (the lines of
    ``sparsekv bench kernels --list``), ``native_extensions``, ``caches``, ``environment``.

    Builds the native kernels where they are not in the cache yet, saying so on stderr first.
    """
    from sparsekv.bench.kernels.variants import variant_lines

    if any(not ext["built"] and not ext["disabled"] for ext in native_extensions()):
        print(BUILD_NOTICE, file=sys.stderr, flush=True)
    kernels = variant_lines()
    return {
        "versions": versions(),
        "cpu": cpu(),
        "kernels": kernels,
        "native_extensions": native_extensions(),
        "caches": caches(),
        "environment": environment(),
    }


def render(document: dict[str, Any]) -> list[str]:
    """Returns the lines ``sparsekv env`` prints for a :func:`report` ``document``."""
    v, c = document["versions"], document["cpu"]
    cuda = v["cuda"]
    if cuda["available"]:
        gpu = f"CUDA {cuda['version']}: " + ", ".join(cuda["devices"])
    else:
        gpu = "CUDA not available" + (
            f" (built for CUDA {cuda['version']})" if cuda["version"] else ""
        )
    generation = f" ({c['generation']})" if c["generation"] else ""
    flags = " ".join(name for name, on in c["flags"].items() if on) or "(none)"
    lines = [
        f"sparsekv      {v['sparsekv']}",
        f"python        {v['python']} ({sys.executable})",
        f"torch         {v['torch']} ({gpu})",
        f"transformers  {v['transformers'] or 'not installed'}",
        f"triton        {v['triton'] or 'not installed'}",
        "",
        f"CPU           {c['model']}",
        f"              {c['vendor']}, family {c['family']}, model {c['model_number']}"
        + generation,
        f"flags         {flags}",
        f"cores         {c['cores']} ({c['usable_cores']} usable here); "
        f"torch intra-op threads {c['torch_threads']}",
        "",
        "native kernels (as `sparsekv bench kernels --list` prints them):",
        *document["kernels"],
        "",
        "caches:",
    ]
    names = {"native_kernels": "native kernels", "loader": "loader", "ruler_data": "RULER data"}
    for key, entry in document["caches"].items():
        lines.append(f"  {names.get(key, key):<15} {entry['path']}  (set {entry['env']} to move)")
        if key != "native_kernels":
            continue
        for ext in document["native_extensions"]:
            state = "disabled" if ext["disabled"] else "built" if ext["built"] else "not built"
            lines.append(f"    {ext['name']:<21} {state:<9} {ext['directory']}")
    lines += ["", "environment (set now):"]
    env = document["environment"]
    lines += [f"  {name}={value}" for name, value in env.items()] or [
        "  (none of SPARSEKV_*, ATEN_CPU_CAPABILITY, ONEDNN_*, DNNL_*, MKL_ENABLE*, "
        "OMP_NUM_THREADS)"
    ]
    return lines


def main(as_json: bool = False) -> int:
    """Print the report (one JSON object with ``as_json``); returns 0."""
    document = report()
    if as_json:
        print(json.dumps(document, indent=2))
    else:
        print("\n".join(render(document)))
    return 0
