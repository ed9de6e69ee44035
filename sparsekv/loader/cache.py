"""The loader's on-disk cache: assembled built-in GGUF files and parsed config/tokenizer.

Root: :func:`sparsekv.cache_root.cache_root` (``$SPARSEKV_CACHE_DIR`` if set, else
``$XDG_CACHE_HOME/sparsekv``, else ``~/.cache/sparsekv``). Entries are written to a temporary sibling and renamed into place, so a
reader never sees a half-written entry and concurrent writers are harmless.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from sparsekv.cache_root import cache_root

__all__ = ["cache_root", "publish", "temporary_sibling"]


def temporary_sibling(target: Path, directory: bool) -> Path:
    """A fresh temporary file or directory next to ``target`` (same filesystem, for rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        return Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    return Path(name)


def publish(temporary: Path, target: Path) -> None:
    """Rename a finished temporary entry to ``target``; if another writer won, drop ours."""
    try:
        os.replace(temporary, target)
    except OSError:
        # A non-empty directory already holds the target: keep the existing entry.
        if temporary.is_dir():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
