"""Pruning of old C++ extension build folders (``ext_cache.cache_folder``'s folders).

Every version of an extension's sources and flags builds in a folder of its own, so folders of
old versions pile up (tens of them, ~5 MB each, on a machine that follows the sources). Every
load or build of a folder touches its marker file (:data:`LAST_USED_MARKER`); after a build of
a new folder, :func:`prune_build_folders` removes the sibling build folders (names of
``cache_folder``'s pattern only) last used more than ``$SPARSEKV_EXT_KEEP_DAYS`` days ago
(default 14; ``0`` never prunes): the marker's time, or the folder's own where it has none. The
folder in use and folders whose build is in progress are kept; a pruning that fails is logged
and never fails the build.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path

logger = logging.getLogger("sparsekv.ext_cache")

STALE_LOCK_SECONDS = 900.0  # 15 min: several times the slowest build seen on a busy 2-core VM
KEEP_DAYS_ENV = "SPARSEKV_EXT_KEEP_DAYS"
DEFAULT_KEEP_DAYS = 14
LAST_USED_MARKER = ".sparsekv-last-used"  # inside a build folder; its mtime: the last use
# cache_folder's names, {prefix}torch{version}-py{XY}-{16 hex digits}, and those of a folder
# that a pruning renamed before removing it (left behind where the removal failed).
BUILD_FOLDER_NAME = re.compile(
    r"(?:[a-z][a-z0-9]*-)?torch[0-9A-Za-z._]+-py[0-9]+-[0-9a-f]{16}(?:\.pruning-[0-9]+)?"
)


def keep_days() -> int:
    """``$SPARSEKV_EXT_KEEP_DAYS``: how many days a build folder may go unused before a build
    of a new folder prunes it (unset or empty: :data:`DEFAULT_KEEP_DAYS`; ``0``: never prune).
    Read per call.

    Raises:
        ValueError: not a whole number of days >= 0 (the message names the variable).
    """
    raw = os.environ.get(KEEP_DAYS_ENV, "").strip()
    if not raw:
        return DEFAULT_KEEP_DAYS
    try:
        days = int(raw)
    except ValueError:
        days = -1
    if days < 0:
        raise ValueError(
            f"{KEEP_DAYS_ENV}: expected a whole number of days >= 0 (0: never prune old "
            f"extension builds), got {raw!r}"
        )
    return days


def mark_used(directory: Path) -> None:
    """Record that build folder ``directory`` is used now: create or touch its
    :data:`LAST_USED_MARKER`. Never raises (a read-only cache is logged at debug level)."""
    marker = Path(directory) / LAST_USED_MARKER
    try:
        marker.touch()
    except OSError as exc:
        logger.debug("cannot record the use of %s: %s", directory, exc)


def last_used(directory: Path) -> float:
    """When build folder ``directory`` was last used (seconds since the epoch): its marker's
    mtime, or the folder's own mtime where it has no marker.

    Raises:
        OSError: the folder does not exist (any more).
    """
    directory = Path(directory)
    try:
        return (directory / LAST_USED_MARKER).stat().st_mtime
    except FileNotFoundError:
        return directory.stat().st_mtime


def prune_build_folders(
    current: Path, days: int | None = None, now: float | None = None
) -> list[Path]:
    """Remove the build folders beside ``current`` unused for more than ``days`` days.

    Candidates are the subfolders of ``current.parent`` (not links) named as
    :func:`cache_folder` names them (:data:`BUILD_FOLDER_NAME`); never ``current`` itself nor a
    folder holding a build lock younger than :data:`STALE_LOCK_SECONDS` (a build in progress).
    One is removed when :func:`last_used` is more than ``days`` x 86400 s before ``now``: renamed
    to ``<name>.pruning-<pid>`` first, so no process finds it half removed, then deleted. A
    folder that cannot be read or removed is logged at debug level and skipped.

    Args:
        current: the build folder in use.
        days: the age limit in days (``None``: :func:`keep_days`; ``0``: remove nothing).
        now: the time to measure ages from (seconds since the epoch; ``None``: now).

    Returns:
        The folders removed (their names before the rename), sorted.

    Raises:
        ValueError: ``days`` is ``None`` and ``$SPARSEKV_EXT_KEEP_DAYS`` is not valid.
    """
    days = keep_days() if days is None else days
    if days <= 0:
        return []
    current = Path(current)
    now = time.time() if now is None else now
    limit = now - days * 86400.0
    try:
        entries = sorted(current.parent.iterdir())
    except OSError as exc:
        logger.debug("cannot list %s to prune old extension builds: %s", current.parent, exc)
        return []
    removed = []
    for folder in entries:
        name = folder.name
        if name == current.name or not BUILD_FOLDER_NAME.fullmatch(name):
            continue
        try:
            if folder.is_symlink() or not folder.is_dir() or last_used(folder) >= limit:
                continue
            lock = folder / "lock"
            if lock.exists() and now - lock.stat().st_mtime <= STALE_LOCK_SECONDS:
                continue
            doomed = folder
            if ".pruning-" not in name:
                doomed = folder.with_name(f"{name}.pruning-{os.getpid()}")
                folder.rename(doomed)
            shutil.rmtree(doomed)
        except OSError as exc:
            logger.debug("cannot prune the old extension build %s: %s", folder, exc)
            continue
        removed.append(folder)
    if removed:
        logger.info(
            "removed %d extension build folder(s) unused for over %d days from %s",
            len(removed),
            days,
            current.parent,
        )
    return removed


def prune_after_build(directory: Path) -> None:
    """:func:`prune_build_folders` beside a folder just built; a failure is only logged."""
    try:
        prune_build_folders(directory)
    except Exception as exc:  # noqa: BLE001 - housekeeping must never fail a build
        logger.warning("old extension builds were not pruned: %s", exc)
