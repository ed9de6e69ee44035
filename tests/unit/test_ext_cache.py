"""Extension build cache: a killed build's lock file is cleared once stale, and a build is logged
while it runs (``sparsekv.ext_cache``)."""

from __future__ import annotations

import logging
import os
import time

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
