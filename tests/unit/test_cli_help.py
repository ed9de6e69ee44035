"""``--help`` of the documented commands reads as plain text (``cli_help``)."""

from __future__ import annotations

import argparse

import pytest

from sparsekv.bench import serve, sweep, throughput
from sparsekv.cli_help import doc_parser, plain_text


def test_plain_text_drops_rest_markup_and_keeps_lines():
    doc = "Runs ``x --y`` via :func:`~sparsekv.a.b` and :mod:`sparsekv.c`.\n\n* one\n* two"
    assert plain_text(doc) == "Runs `x --y` via `sparsekv.a.b` and `sparsekv.c`.\n\n* one\n* two"


def test_help_shows_defaults_once_and_keeps_the_docstring_lines(capsys):
    parser = doc_parser("demo", "First line.\n\n* a ``b``\n* c")
    parser.add_argument("--n", type=int, default=3, help="count")
    parser.add_argument("--m", default=None, help="no default shown")
    parser.add_argument("--k", type=int, default=5, help="count (default 5)")
    parser.add_argument("--flag", action="store_true", help="a switch")
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "First line.\n\n* a `b`\n* c\n" in out
    assert "count (default: 3)" in out
    assert "no default shown\n" in out
    assert "count (default 5)\n" in out and "(default 5) (default" not in out
    assert "a switch\n" in out


@pytest.mark.parametrize("module", [serve, sweep, throughput])
def test_bench_help_has_no_rest_markup(module):
    parser = module.build_parser() if hasattr(module, "build_parser") else None
    if parser is None:
        pytest.fail(f"{module.__name__} has no build_parser")
    assert isinstance(parser, argparse.ArgumentParser)
    text = parser.format_help()
    assert "``" not in text and ":mod:`" not in text and ":func:`" not in text
