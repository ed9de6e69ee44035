"""Housekeeping of the C++ extensions' build cache (``~/.cache/sparsekv/ext``).

Root: ``$SPARSEKV_EXT_DIR``, else ``ext`` under sparsekv's cache root (``$SPARSEKV_CACHE_DIR``,
``$XDG_CACHE_HOME/sparsekv`` or ``~/.cache/sparsekv``); every version of an extension's sources and flags builds in a folder
of its own there (:func:`cache_folder`).

:func:`build_progress` logs a build while it runs: a build takes one to three minutes on two
cores, and a server that says nothing for that long looks hung.

``torch.utils.cpp_extension`` serialises builds of one folder with a ``lock`` file that the
builder deletes when it finishes; a builder that is killed (out of memory, Ctrl-C, a CI timeout)
leaves it behind, and every later process then waits on it forever. A build here takes one to
three minutes, so a lock much older than that has no live builder.

Old build folders are pruned after a new one is built (``ext_prune``: unused for
``$SPARSEKV_EXT_KEEP_DAYS`` days, default 14).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from sparsekv.cache_root import cache_root
from sparsekv.ext_prune import STALE_LOCK_SECONDS, mark_used, prune_after_build

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 15.0


def clear_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_SECONDS) -> bool:
    """Delete ``directory / "lock"`` if it is older than ``max_age_s`` seconds.

    Returns:
        True when a stale lock was removed (a ``RuntimeWarning`` says so).
    """
    lock = Path(directory) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False
    lock.unlink(missing_ok=True)
    warnings.warn(
        f"removed a stale extension build lock ({lock}, {age / 60:.0f} min old): "
        "a killed build left it; rebuilding",
        RuntimeWarning,
        stacklevel=2,
    )
    return True


@contextlib.contextmanager
def build_progress(
    name: str, directory: Path, num_sources: int, interval_s: float = PROGRESS_INTERVAL_S
) -> Iterator[None]:
    """Log the compilation of extension ``name`` into ``directory`` while the block runs.

    Nothing is logged when ``directory / f"{name}.so"`` exists (the extension loads from the
    cache in about a second). Otherwise one INFO line at the start, one every ``interval_s``
    seconds with the count of object files compiled so far out of ``num_sources``, and one at
    the end with the time taken.
    """
    directory = Path(directory)
    if (directory / f"{name}.so").exists():
        yield
        return
    start = time.monotonic()
    logger.info(
        "building native kernels %s (%d C++ sources; once per machine and version, about "
        "1-3 min on 2 cores) in %s",
        name,
        num_sources,
        directory,
    )
    done = threading.Event()

    def report() -> None:
        while not done.wait(interval_s):
            compiled = len(list(directory.glob("*.o")))
            logger.info(
                "building %s: %d/%d sources compiled, %.0f s",
                name,
                min(compiled, num_sources),
                num_sources,
                time.monotonic() - start,
            )

    reporter = threading.Thread(target=report, name=f"{name}-build-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
    logger.info("built %s in %.0f s", name, time.monotonic() - start)


def cache_folder(
    prefix: str, csrc_dir: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...]
) -> Path:
    """Build folder of one extension: one per torch and Python version and version of the
    sources and flags, so another version of ``csrc_dir`` never shares it.

    Args:
        prefix: the extension's folder prefix (``""``, ``"fused-"``, ``"quant-"``).
        csrc_dir: folder of the sources and headers; every file's name and bytes are digested.
        cflags / ldflags: the compiler and linker flags (digested too).

    Returns:
        ``$SPARSEKV_EXT_DIR`` (else ``ext`` under :func:`sparsekv.cache_root.cache_root`:
        ``$SPARSEKV_CACHE_DIR/ext``, ``$XDG_CACHE_HOME/sparsekv/ext`` or
        ``~/.cache/sparsekv/ext``) ``/ {prefix}torch{version}-py{XY}-{digest[:16]}``.
    """
    import torch

    digest = hashlib.sha256()
    for path in sorted(Path(csrc_dir).iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(tuple(cflags) + tuple(ldflags)).encode())
    root = os.environ.get("SPARSEKV_EXT_DIR")
    base = Path(root) if root else cache_root() / "ext"
    version = sys.version_info
    tag = f"torch{torch.__version__.replace('+', '_')}-py{version[0]}{version[1]}"
    return base / f"{prefix}{tag}-{digest.hexdigest()[:16]}"


def compile_operators(
    name: str,
    csrc_dir: Path,
    sources: tuple[str, ...],
    cflags: list[str],
    ldflags: list[str],
    directory: Path,
    verbose: bool = False,
) -> None:
    """Compile (or reload from ``directory``) a ``TORCH_LIBRARY`` extension into ``torch.ops``.

    Clears a killed build's lock first and logs the build's progress (:func:`build_progress`).
    A library already built in ``directory`` (no build in progress) is loaded as it is, whatever
    checkout built it: ``directory`` names the version of the sources. Either way the folder's
    use is recorded (:func:`mark_used`); after a successful build of a folder that held no
    library yet, old sibling build folders are pruned (:func:`prune_build_folders`; a failure
    there is logged, never raised).

    Args:
        name: the extension's name (``TORCH_EXTENSION_NAME``).
        csrc_dir: folder of the sources and headers (also the include path).
        sources: file names inside ``csrc_dir``.
        cflags / ldflags: compiler and linker flags (copied: ``cpp_extension`` appends to the
            lists it is given, which would change a caller's digest of them).
        directory: the build folder (created when missing).
        verbose: print the compiler's commands.

    Raises:
        RuntimeError: the build failed (from ``torch.utils.cpp_extension``).
    """
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(directory)  # a killed build's lock would hang this process forever
    mark_used(directory)  # before a build too: a pruning elsewhere must not take this folder
    library = directory / f"{name}.so"
    is_new = not library.exists()
    if not is_new and not (directory / "lock").exists():
        # The folder name is a digest of the sources and flags, so a built library there is
        # current. Loading it directly skips cpp_extension's ninja check, which compares the
        # absolute source paths of the last build and would rebuild for every other checkout.
        import torch

        torch.ops.load_library(str(library))
        return
    with build_progress(name, directory, len(sources)):
        cpp_extension.load(
            name=name,
            sources=[str(csrc_dir / source) for source in sources],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            extra_include_paths=[str(csrc_dir)],
            build_directory=str(directory),
            verbose=verbose,
            is_python_module=False,  # TORCH_LIBRARY operators, loaded into torch.ops
        )
    if is_new:
        prune_after_build(directory)


class ExtensionScope:
    """Within the ``with`` block, ``var`` holds ``resolve()``'s value: an extension and the
    settings its kernels would otherwise check on every call, resolved once on entry (``None``:
    resolve per call, as outside any scope). Reset on exit, exceptions included; reentrant, and
    per thread and task (a context variable)."""

    __slots__ = ("_var", "_resolve", "_token")

    def __init__(self, var: contextvars.ContextVar, resolve: Callable[[], object]) -> None:
        self._var, self._resolve = var, resolve

    def __enter__(self) -> ExtensionScope:
        self._token = self._var.set(self._resolve())
        return self

    def __exit__(self, *exc) -> None:
        self._var.reset(self._token)
