"""Where the RULER data is written (``evaluation.ruler_data.cache_dir``): under the loader's cache
root, read per call; the deprecated ``SPARSEKV_CACHE`` still wins where set, with one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from sparsekv.evaluation import ruler_data
from sparsekv.loader.cache import cache_root


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("SPARSEKV_CACHE", "SPARSEKV_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ruler_data, "_deprecation_warned", False)


def test_the_ruler_folder_follows_the_loader_root_at_call_time(monkeypatch, tmp_path):
    assert ruler_data.cache_dir() == Path.home() / ".cache" / "sparsekv" / "ruler"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ruler_data.cache_dir() == tmp_path / "xdg" / "sparsekv" / "ruler"
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "root"))
    assert ruler_data.cache_dir() == tmp_path / "root" / "ruler" == cache_root() / "ruler"
    assert not (tmp_path / "root").exists()  # not created by asking


def test_the_deprecated_variable_wins_and_warns_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "old"))
    with caplog.at_level(logging.WARNING, logger="sparsekv.evaluation.ruler_data"):
        assert ruler_data.cache_dir() == tmp_path / "old" / "ruler"
        assert ruler_data.cache_dir() == tmp_path / "old" / "ruler"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "SPARSEKV_CACHE is deprecated: set SPARSEKV_CACHE_DIR" in warnings[0]
    monkeypatch.setenv("SPARSEKV_CACHE", "")  # empty counts as unset
    assert ruler_data.cache_dir() == tmp_path / "root" / "ruler"


def test_the_tokenizer_folder_is_written_under_the_ruler_folder(monkeypatch, tmp_path):
    class Tokenizer:
        def save_pretrained(self, folder: str) -> None:
            Path(folder).mkdir(parents=True)
            (Path(folder) / "tokenizer_config.json").write_text("{}")

    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "root"))
    folder = ruler_data.tokenizer_dir(Tokenizer())
    assert folder.parent == tmp_path / "root" / "ruler"
    assert folder.name.startswith("tokenizer-") and (folder / "tokenizer_config.json").is_file()
