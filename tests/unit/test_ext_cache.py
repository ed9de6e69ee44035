"""Extension build cache: a killed build's lock file is cleared once stale, and a build is logged
while it runs (``sparsekv.ext_cache``)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from sparsekv.ext_cache import STALE_LOCK_SECONDS, clear_stale_lock


def test_stale_lock_is_removed_with_a_warning(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="stale extension build lock"):
        assert clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_fresh_lock_and_no_lock_are_left_alone(tmp_path):
    assert not clear_stale_lock(tmp_path)  # no lock
    lock = tmp_path / "lock"
    lock.write_text("")  # a build in progress
    assert not clear_stale_lock(tmp_path)
    assert lock.exists()
    assert not clear_stale_lock(tmp_path, max_age_s=3600)


def test_build_modules_clear_the_lock_before_building(tmp_path, monkeypatch):
    """Both extensions call it on their build folder before ``cpp_extension.load``."""
    from torch.utils import cpp_extension

    from sparsekv import ext_cache
    from sparsekv.attention.cpu import build as attention_build

    seen = []
    monkeypatch.setattr(attention_build, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(ext_cache, "clear_stale_lock", lambda d: seen.append(d))

    def fake_load(**kwargs):
        assert seen == [tmp_path] and kwargs["build_directory"] == str(tmp_path)
        raise RuntimeError("stop before building")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with pytest.raises(RuntimeError, match="stop before building"):
        attention_build.compile_extension()
    assert seen == [tmp_path]


def test_build_progress_logs_a_build_and_stays_quiet_on_a_cached_load(tmp_path, caplog):
    from sparsekv.ext_cache import build_progress

    caplog.set_level(logging.INFO, logger="sparsekv.ext_cache")
    with build_progress("ext", tmp_path, 3, interval_s=0.01):
        (tmp_path / "a.o").write_bytes(b"")
        (tmp_path / "b.o").write_bytes(b"")
        deadline = time.monotonic() + 30
        while "2/3 sources compiled" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / "ext.so").write_bytes(b"")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == (
        "building native kernels ext (3 C++ sources; once per machine and version, about "
        f"1-3 min on 2 cores) in {tmp_path}"
    )
    assert any(m.startswith("building ext: 2/3 sources compiled, ") for m in messages[1:-1])
    assert messages[-1].startswith("built ext in ") and messages[-1].endswith(" s")
    caplog.clear()
    with build_progress("ext", tmp_path, 3, interval_s=0.01):
        time.sleep(0.05)
    assert caplog.records == []


def test_a_built_library_loads_without_a_build_from_any_checkout(tmp_path, monkeypatch):
    """The cache folder names the sources' digest, so its library is loaded as it is: no ninja
    check against the absolute source paths of whichever checkout built it (which would rebuild
    for every other checkout). While a build holds the lock the library is not touched."""
    from torch.utils import cpp_extension

    from sparsekv.attention.cpu import build as attention_build
    from sparsekv.ext_cache import compile_operators

    attention_build.compile_extension()  # built (or already cached) from this checkout
    name = attention_build.EXTENSION_NAME

    def no_build(**kwargs):
        raise AssertionError("a cached library must not be rebuilt")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    elsewhere = tmp_path / "another-checkout" / "csrc"  # sources that do not even exist
    compile_operators(name, elsewhere, ("a.cpp",), [], [], attention_build.build_directory())

    building = tmp_path / "cache"  # a build in progress: go through cpp_extension (and wait)
    building.mkdir()
    (building / f"{name}.so").write_bytes(b"")  # half written
    (building / "lock").write_text("")
    with pytest.raises(AssertionError, match="must not be rebuilt"):
        compile_operators(name, elsewhere, ("a.cpp",), [], [], building)


# ------------------------------------------------------------------ pruning old build folders
DAY = 86400.0
NOW = 2_000_000_000.0  # a fixed "now" for prune_build_folders (2033)
CURRENT = "torch2.13.0_cpu-py311-" + "a" * 16


def _folder(root, name, age_days=None, marker_days=None, lock_days=None, now=NOW):
    """A build folder ``name`` under ``root`` with a library in it; the folder's mtime, its
    last-use marker's and its lock's set ``*_days`` before ``now`` (``None``: no marker / no
    lock / the folder's mtime stays the real time)."""
    from sparsekv.ext_prune import LAST_USED_MARKER

    folder = root / name
    folder.mkdir()
    (folder / "ext.so").write_bytes(b"")
    for file_name, days in ((LAST_USED_MARKER, marker_days), ("lock", lock_days)):
        if days is not None:
            (folder / file_name).write_text("")
            os.utime(folder / file_name, (now - days * DAY,) * 2)
    if age_days is not None:
        os.utime(folder, (now - age_days * DAY,) * 2)  # last: creating files changes it
    return folder


def test_prune_removes_exactly_the_unused_build_folders(tmp_path):
    from sparsekv.ext_prune import prune_build_folders

    root = tmp_path / "ext"
    root.mkdir()
    current = _folder(root, CURRENT, age_days=100)  # in use: never removed, however old
    removed = {
        _folder(root, "quant-torch2.13.0_cpu-py311-" + "1" * 16, age_days=20),  # no marker
        _folder(root, "fused-torch2.1.0_cu121-py310-" + "2" * 16, marker_days=15),  # fresh dir
        _folder(root, "torch2.13.0_cpu-py311-" + "3" * 16, age_days=30, lock_days=20),  # stale
        _folder(root, "torch2.13.0_cpu-py311-" + "4" * 16 + ".pruning-77", age_days=30),
    }
    kept = {
        current,
        _folder(root, "torch2.13.0_cpu-py311-" + "5" * 16, age_days=30, marker_days=1),
        _folder(root, "torch2.13.0_cpu-py311-" + "6" * 16, age_days=13),
        _folder(root, "torch2.13.0_cpu-py311-" + "7" * 16, marker_days=13.9),
        _folder(root, "torch2.13.0_cpu-py311-" + "8" * 16, age_days=30, lock_days=0),  # building
        # not our names
        _folder(root, "notes", age_days=100),
        _folder(root, "torch-custom", age_days=100),
        _folder(root, "torch2.13.0_cpu-py311-abc", age_days=100),  # short digest
        _folder(root, "torch2.13.0_cpu-py311-" + "A" * 16, age_days=100),
        _folder(root, "mytorch2.13.0_cpu-py311-" + "9" * 16, age_days=100),
        _folder(root, "torch2.13.0_cpu-py311-" + "b" * 16 + ".old", age_days=100),
    }
    outside = _folder(tmp_path, "torch2.13.0_cpu-py311-" + "c" * 16, age_days=100)
    link = root / ("torch2.13.0_cpu-py311-" + "d" * 16)
    link.symlink_to(outside)  # a link is never followed nor removed
    a_file = root / ("torch2.13.0_cpu-py311-" + "e" * 16)
    a_file.write_text("")
    os.utime(a_file, (NOW - 100 * DAY,) * 2)
    kept |= {link, a_file}

    assert set(prune_build_folders(current, days=14, now=NOW)) == removed
    assert set(root.iterdir()) == kept
    assert outside.is_dir() and (outside / "ext.so").exists()
    assert prune_build_folders(current, days=14, now=NOW) == []  # nothing left to remove


def test_keep_days_comes_from_the_environment(tmp_path, monkeypatch):
    from sparsekv.ext_prune import DEFAULT_KEEP_DAYS, KEEP_DAYS_ENV, keep_days, prune_build_folders

    monkeypatch.delenv(KEEP_DAYS_ENV, raising=False)
    assert keep_days() == DEFAULT_KEEP_DAYS == 14
    root = tmp_path / "ext"
    root.mkdir()
    current = _folder(root, CURRENT)
    five = _folder(root, "torch2.13.0_cpu-py311-" + "5" * 16, age_days=5)
    two = _folder(root, "torch2.13.0_cpu-py311-" + "2" * 16, age_days=2)
    assert prune_build_folders(current, now=NOW) == []  # 14 days: both young
    monkeypatch.setenv(KEEP_DAYS_ENV, " 3 ")
    assert keep_days() == 3
    assert prune_build_folders(current, now=NOW) == [five]
    assert set(root.iterdir()) == {current, two}


def test_zero_days_disables_pruning(tmp_path, monkeypatch):
    from sparsekv.ext_prune import KEEP_DAYS_ENV, keep_days, prune_build_folders

    root = tmp_path / "ext"
    root.mkdir()
    current = _folder(root, CURRENT)
    old = _folder(root, "torch2.13.0_cpu-py311-" + "1" * 16, age_days=1000)
    monkeypatch.setenv(KEEP_DAYS_ENV, "0")
    assert keep_days() == 0
    assert prune_build_folders(current, now=NOW) == []
    assert prune_build_folders(current, days=0, now=NOW) == []
    assert set(root.iterdir()) == {current, old}


@pytest.mark.parametrize("value", ["two weeks", "-1", "1.5", "14d"])
def test_a_bad_keep_days_value_is_refused(tmp_path, monkeypatch, value):
    from sparsekv.ext_prune import KEEP_DAYS_ENV, keep_days, prune_build_folders

    monkeypatch.setenv(KEEP_DAYS_ENV, value)
    with pytest.raises(ValueError, match=f"SPARSEKV_EXT_KEEP_DAYS: .*got {value!r}"):
        keep_days()
    with pytest.raises(ValueError, match="SPARSEKV_EXT_KEEP_DAYS"):
        prune_build_folders(tmp_path / CURRENT, now=NOW)


def test_mark_used_creates_then_touches_the_marker(tmp_path):
    from sparsekv.ext_prune import LAST_USED_MARKER, last_used, mark_used

    folder = _folder(tmp_path, CURRENT, age_days=30)
    assert last_used(folder) == NOW - 30 * DAY  # no marker: the folder's own mtime
    before = time.time()
    mark_used(folder)
    marker = folder / LAST_USED_MARKER
    assert marker.is_file() and marker.stat().st_mtime >= before - 1
    os.utime(marker, (NOW - 20 * DAY,) * 2)
    assert last_used(folder) == NOW - 20 * DAY  # the marker wins over the folder
    mark_used(folder)
    assert last_used(folder) >= before - 1
    mark_used(tmp_path / "missing")  # cannot record: logged, not raised


def _fake_build(monkeypatch, built: list):
    """``cpp_extension.load`` writes the library into its build folder and records the call."""
    from torch.utils import cpp_extension

    def fake_load(**kwargs):
        directory = kwargs["build_directory"]
        built.append(directory)
        (Path(directory) / f"{kwargs['name']}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)


def test_a_build_of_a_new_folder_prunes_old_siblings(tmp_path, monkeypatch):
    from sparsekv.ext_cache import compile_operators
    from sparsekv.ext_prune import KEEP_DAYS_ENV, LAST_USED_MARKER

    monkeypatch.delenv(KEEP_DAYS_ENV, raising=False)
    built = []
    _fake_build(monkeypatch, built)
    root = tmp_path / "ext"
    root.mkdir()
    _folder(root, "torch2.13.0_cpu-py311-" + "1" * 16, age_days=15, now=time.time())
    young = _folder(root, "torch2.13.0_cpu-py311-" + "2" * 16, age_days=13, now=time.time())
    current = root / CURRENT
    start = time.time()
    compile_operators("ext", tmp_path, ("a.cpp",), [], [], current)
    assert built == [str(current)]
    assert (current / LAST_USED_MARKER).stat().st_mtime >= start - 1
    assert set(root.iterdir()) == {current, young}


def test_loading_or_rebuilding_a_folder_records_its_use_and_prunes_nothing(tmp_path, monkeypatch):
    import torch

    from sparsekv.ext_cache import compile_operators
    from sparsekv.ext_prune import LAST_USED_MARKER

    built, loaded = [], []
    _fake_build(monkeypatch, built)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    root = tmp_path / "ext"
    root.mkdir()
    old = _folder(root, "torch2.13.0_cpu-py311-" + "1" * 16, age_days=100, now=time.time())
    current = _folder(root, CURRENT, marker_days=30, now=time.time())  # holds ext.so
    start = time.time()
    compile_operators("ext", tmp_path, ("a.cpp",), [], [], current)  # a cached load
    assert loaded == [str(current / "ext.so")] and built == []
    assert (current / LAST_USED_MARKER).stat().st_mtime >= start - 1
    (current / "lock").write_text("")  # another build holds the folder: rebuilt, not new
    compile_operators("ext", tmp_path, ("a.cpp",), [], [], current)
    assert built == [str(current)]
    assert old.is_dir()


def test_a_failed_pruning_never_fails_the_build(tmp_path, monkeypatch, caplog):
    from sparsekv import ext_cache, ext_prune

    built = []
    _fake_build(monkeypatch, built)
    root = tmp_path / "ext"
    root.mkdir()
    old = _folder(root, "torch2.13.0_cpu-py311-" + "1" * 16, age_days=100, now=time.time())
    monkeypatch.setenv(ext_prune.KEEP_DAYS_ENV, "soon")
    caplog.set_level(logging.DEBUG, logger="sparsekv.ext_cache")
    ext_cache.compile_operators("ext", tmp_path, ("a.cpp",), [], [], root / CURRENT)
    assert built == [str(root / CURRENT)] and old.is_dir()
    assert "old extension builds were not pruned: SPARSEKV_EXT_KEEP_DAYS" in caplog.text

    monkeypatch.delenv(ext_prune.KEEP_DAYS_ENV)

    def refuse(path, *args, **kwargs):
        raise PermissionError(f"cannot remove {path}")

    monkeypatch.setattr(ext_prune.shutil, "rmtree", refuse)
    ext_cache.compile_operators("ext", tmp_path, ("a.cpp",), [], [], root / (CURRENT[:-1] + "b"))
    assert len(built) == 2
    assert "cannot prune the old extension build" in caplog.text
    # renamed out of the way, so no process loads it half removed; removed by a later pruning
    assert set(root.iterdir()) == {
        root / CURRENT,
        root / (CURRENT[:-1] + "b"),
        root / f"{old.name}.pruning-{os.getpid()}",
    }
