"""Housekeeping of the C++ extensions' build cache (``~/.cache/sparsekv/ext``).

``torch.utils.cpp_extension`` serialises builds of one folder with a ``lock`` file that the
builder deletes when it finishes; a builder that is killed (out of memory, Ctrl-C, a CI timeout)
leaves it behind, and every later process then waits on it forever. A build here takes one to
three minutes, so a lock much older than that has no live builder.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

STALE_LOCK_SECONDS = 900.0  # 15 min: several times the slowest build seen on a busy 2-core VM


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
