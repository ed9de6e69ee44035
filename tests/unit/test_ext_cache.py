"""A killed extension build's lock file is cleared once stale (``sparsekv.ext_cache``)."""

from __future__ import annotations

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

    from sparsekv.attention.cpu import build as attention_build

    seen = []
    monkeypatch.setattr(attention_build, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(attention_build, "clear_stale_lock", lambda d: seen.append(d))

    def fake_load(**kwargs):
        assert seen == [tmp_path] and kwargs["build_directory"] == str(tmp_path)
        raise RuntimeError("stop before building")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with pytest.raises(RuntimeError, match="stop before building"):
        attention_build.compile_extension()
    assert seen == [tmp_path]
