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


@pytest.mark.parametrize(
    "message, flag",
    [
        ("kv_compression.budget (16) must be >= window + 1 (33)", "--kv-budget"),
        ("kv_compression.method: unknown 'x'", "--kv-compression"),
        ("compression_ratio must be in (0, 1)", "--kv-compression-ratio"),
        ("kv_cache_memory: 3 GiB exceeds 80%", "--kv-cache-memory"),
        ("watermark_pages must be >= 0", "--watermark-pages"),
        ("model: built-in 'x' needs the package y", "--model"),
        ("prompt: its 751 tokens need 458 KV pages", None),
        ("max_tokens: the request needs 9 pages", None),
        ("something else entirely", None),
    ],
)
def test_an_error_names_the_flag_of_its_field(message, flag):
    from sparsekv.cli import error_line
    from sparsekv.cli_args import flag_of_error

    assert flag_of_error(message) == flag
    assert error_line(ValueError(message)) == f"error: {message}" + (f" [{flag}]" if flag else "")


def test_the_cli_names_the_flag_of_a_bad_compression_setting(capsys):
    from sparsekv import cli

    # Refused while the config is resolved, before any model loads.
    status = cli.main(["generate", "--prompt", "hi", "--kv-budget", "16"])
    assert status == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: kv_compression.budget (16) must be >= window + 1 (33) [--kv-budget]")
    )


def test_generate_takes_prompts_as_arguments(tmp_path):
    from sparsekv import cli

    file = tmp_path / "p.txt"
    file.write_text("c\n\nd\n", encoding="utf-8")
    args = cli.build_parser().parse_args(
        ["generate", "a b", "e", "--prompt", "x", "--prompts-file", str(file), "--max-tokens", "4"]
    )
    assert cli.read_prompts(args) == ["a b", "e", "x", "c", "d"]
    assert cli.read_prompts(cli.build_parser().parse_args(["generate"])) == [cli.DEFAULT_PROMPT]


def test_a_prompts_file_is_split_at_newlines_only_and_must_hold_a_prompt(tmp_path):
    from sparsekv import cli

    file = tmp_path / "p.txt"
    file.write_bytes("Say hi\x0bSay mid\x0cSay end\u2028Next\r\n\r\nlast".encode())
    args = cli.build_parser().parse_args(["generate", "--prompts-file", str(file)])
    assert cli.read_prompts(args) == ["Say hi\x0bSay mid\x0cSay end\u2028Next", "last"]
    file.write_text("\n  \n\r\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"^--prompts-file: .* holds no prompt"):
        cli.read_prompts(args)
    assert cli.main(["generate", "--prompts-file", str(file)]) == 2  # before the model loads


@pytest.mark.parametrize("value", ["nan", "0", "-1"])
def test_serve_refuses_a_request_timeout_that_is_not_positive(value):
    # NaN compares false with everything: it passed a `<= 0` check and timed out every request.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "sparsekv.cli", "serve", "--port", "0", "--request-timeout", value],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("error: request_timeout must be > 0 seconds")
    )
