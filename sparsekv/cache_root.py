"""The root of sparsekv's on-disk caches (models, parsed metadata, RULER data, built kernels).

``$SPARSEKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/sparsekv``, else ``~/.cache/sparsekv``
(the XDG base directory specification's user cache directory). Each cache is a folder under it;
the built kernels' folder (``ext``) can be moved on its own with ``SPARSEKV_EXT_DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache directory (not created)."""
    if os.environ.get("SPARSEKV_CACHE_DIR"):
        return Path(os.environ["SPARSEKV_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sparsekv"
