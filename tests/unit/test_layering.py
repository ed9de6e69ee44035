"""The import layering of ``sparsekv/`` (docs/design.md, "Layering"), checked on the source.

Tiers, top to bottom; a module imports its own tier or lower ones, never a higher one:

5 app       ``cli``, ``cli_args``, ``server``, ``bench``, ``evaluation`` (and the package root)
4 engine    ``engine``, ``llm``
3 step      ``engine.scheduler`` (+ its request and output types), ``kv_cache``, ``runner``,
            ``sampling``, ``spec_decode``
2 models    ``models``, ``loader``, ``compression``
1 attention ``attention`` (the backend interface and implementations, the PyTorch reference)
0 kernels   ``attention.cpu``, ``attention.triton``, ``models.fused`` (compiled / Triton ops)
- base      vocabulary every tier may import: ``config``, ``outputs``, ``sampling_params``,
            ``cache_root``, ``ext_cache``, ``ext_prune``, ``host_allocator``, ``kv_cache.spec``, ``kv_cache.quant``,
            ``attention.paging``; they import only each other.

Beyond the tiers: ``compression`` never imports a kernel package (it runs on the backend object
it is handed); ``kv_cache`` imports no ``models`` and, of ``attention``, only the backend
interface (``attention.backends``, ``.base``) and the page layout (``attention.paging``).
Every import counts, including the ones inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "sparsekv"

BASE = -1
TIERS = {  # longest matching prefix wins
    "sparsekv": 5,
    "sparsekv.cli": 5,
    "sparsekv.cli_args": 5,
    "sparsekv.server": 5,
    "sparsekv.bench": 5,
    "sparsekv.evaluation": 5,
    "sparsekv.models.fused.bench": 5,  # a benchmark script beside the kernels it times
    "sparsekv.engine": 4,
    "sparsekv.llm": 4,
    "sparsekv.distributed.tp_launch": 4,  # tensor parallelism: starts the ranks of an engine
    "sparsekv.distributed.tp_engine": 4,
    "sparsekv.engine.scheduler": 3,
    "sparsekv.engine.scheduler_output": 3,
    "sparsekv.engine.request": 3,
    "sparsekv.kv_cache": 3,
    "sparsekv.runner": 3,
    "sparsekv.sampling": 3,
    "sparsekv.distributed.tp_plan": 3,
    "sparsekv.spec_decode": 3,
    "sparsekv.models": 2,
    "sparsekv.loader": 2,
    "sparsekv.compression": 2,
    "sparsekv.distributed.tp_model": 2,
    "sparsekv.distributed.tp_compression": 2,
    "sparsekv.distributed.tp_layout": 2,
    "sparsekv.attention": 1,
    "sparsekv.attention.cpu": 0,
    "sparsekv.attention.triton": 0,
    "sparsekv.models.fused": 0,
    "sparsekv.config": BASE,
    "sparsekv.parallel_config": BASE,
    "sparsekv.env_flags": BASE,
    "sparsekv.compression_config": BASE,
    "sparsekv.speculative_config": BASE,
    "sparsekv.outputs": BASE,
    "sparsekv.sampling_params": BASE,
    "sparsekv.errors": BASE,
    "sparsekv.cache_root": BASE,
    "sparsekv.ext_cache": BASE,
    "sparsekv.ext_prune": BASE,
    "sparsekv.host_allocator": BASE,
    "sparsekv.kv_cache.spec": BASE,
    "sparsekv.kv_cache.quant": BASE,
    "sparsekv.attention.paging": BASE,
}
KERNEL_PACKAGES = ("sparsekv.attention.cpu", "sparsekv.attention.triton", "sparsekv.models.fused")
KV_CACHE_ATTENTION = ("sparsekv.attention.backends", "sparsekv.attention.paging")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def tier(module: str) -> int:
    """The tier of a ``sparsekv`` module (longest prefix in :data:`TIERS`)."""
    matches = [prefix for prefix in TIERS if _within(module, prefix)]
    return TIERS[max(matches, key=len)]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every ``sparsekv`` module ``source`` imports (``from a import b`` counts ``a.b`` where
    that is a module, else ``a``); relative imports resolved against ``module``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return {name for name in found if _within(name, "sparsekv")}


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(module: str, imports: set[str]) -> list[str]:
    """Why each of ``module``'s imports breaks the layering (empty when none does)."""
    found = []
    for target in sorted(imports):
        if tier(target) > tier(module):
            found.append(f"{module} (tier {tier(module)}) imports {target} (tier {tier(target)})")
        if tier(module) == BASE and tier(target) != BASE:
            found.append(f"{module} is base vocabulary but imports {target}")
        if _within(module, "sparsekv.compression") and any(
            _within(target, kernels) for kernels in KERNEL_PACKAGES
        ):
            found.append(f"{module} imports the kernel module {target} (use the backend)")
        if _within(module, "sparsekv.kv_cache"):
            if _within(target, "sparsekv.models"):
                found.append(f"{module} imports {target} (kv_cache imports no models)")
            if _within(target, "sparsekv.attention") and not any(
                _within(target, allowed) for allowed in KV_CACHE_ATTENTION
            ):
                found.append(f"{module} imports the attention implementation {target}")
    return found


def _sources() -> list[tuple[str, Path]]:
    return [(module_name(path), path) for path in sorted(ROOT.rglob("*.py"))]


def test_no_module_imports_up_the_layering():
    found = []
    for module, path in _sources():
        imports = imported_modules(path.read_text(), module, path.name == "__init__.py")
        found += violations(module, imports)
    assert not found, "\n".join(found)


def test_the_walk_sees_the_whole_package():
    modules = dict(_sources())
    assert len(modules) > 150
    imports = imported_modules(
        modules["sparsekv.kv_cache.storage.base"].read_text(), "sparsekv.kv_cache.storage.base",
        False,
    )  # fmt: skip
    assert "sparsekv.attention.backends" in imports and "sparsekv.attention.paging" in imports


@pytest.mark.parametrize(
    ("module", "source", "reason"),
    [
        ("sparsekv.kv_cache.storage.x", "from sparsekv.attention.cpu import ops", "implementation"),
        ("sparsekv.kv_cache.x", "from sparsekv.models.fused import ops", "imports no models"),
        ("sparsekv.kv_cache.x", "import sparsekv.attention.torch_ref", "implementation"),
        ("sparsekv.compression.x", "from sparsekv.attention.cpu import window_fused", "kernel"),
        ("sparsekv.compression.x", "from sparsekv.models.fused.ops import write_kv_", "kernel"),
        ("sparsekv.attention.x", "from sparsekv.kv_cache.storage import KVStorage", "tier 1"),
        ("sparsekv.attention.cpu.x", "from sparsekv.attention import torch_ref", "tier 0"),
        ("sparsekv.models.x", "from sparsekv.runner import paged_attention", "tier 2"),
        ("sparsekv.engine.x", "from sparsekv.server import app", "tier 4"),
        ("sparsekv.runner.x", "def f():\n    from sparsekv.bench import common", "tier 3"),
        ("sparsekv.config", "from sparsekv.attention.backends import BACKENDS", "base"),
        ("sparsekv.kv_cache.storage.x", "from ...attention.cpu import ops", "implementation"),
    ],
)
def test_a_violating_module_is_reported(module, source, reason):
    imports = imported_modules(source, module, False)
    found = violations(module, imports)
    assert found and any(reason in line for line in found), found


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("sparsekv.kv_cache.storage.x", "from sparsekv.attention.backends import DecodeParams"),
        ("sparsekv.kv_cache.x", "from sparsekv.attention.paging import gather_kv"),
        ("sparsekv.compression.x", "from sparsekv.attention.backends.base import AttentionBackend"),
        ("sparsekv.runner.x", "from sparsekv.models.fused import ops"),
        ("sparsekv.cli", "from sparsekv.server import app"),
        ("sparsekv.bench.x", "from sparsekv.evaluation import report"),
        ("sparsekv.attention.backends.x", "from sparsekv.attention.cpu import ops"),
    ],
)
def test_an_allowed_import_passes(module, source):
    assert violations(module, imported_modules(source, module, False)) == []


def test_config_names_every_backend():
    from sparsekv.attention.backends import BACKEND_NAMES
    from sparsekv.config import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == BACKEND_NAMES
