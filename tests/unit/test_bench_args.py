"""Counts and lists of the bench and eval commands: a value that cannot run is an ``error:``
line (argparse, exit 2) or a ``ValueError`` naming it before any model loads, never a silent
default or a traceback."""

from __future__ import annotations

import pytest

from sparsekv.bench import fidelity, serve, sweep, throughput
from sparsekv.evaluation import main as eval_main


@pytest.mark.parametrize(
    ("parser", "argv", "message"),
    [
        (throughput.build_parser, ["--output-len", "0"], "--output-len: must be >= 1, got 0"),
        (throughput.build_parser, ["--num-prompts", "-1"], "--num-prompts: must be >= 0, got -1"),
        (throughput.build_parser, ["--input-len", "x"], "--input-len: expected an integer"),
        (fidelity.build_parser, ["--num-texts", "0"], "--num-texts: must be >= 1, got 0"),
        (fidelity.build_parser, ["--output-len", "0"], "--output-len: must be >= 1, got 0"),
        (sweep.build_parser, ["--concurrency", "1", "0"], "--concurrency: must be >= 1, got 0"),
        (sweep.build_parser, ["--prompts-per-slot", "0"], "--prompts-per-slot: must be >= 1"),
        (sweep.build_parser, ["--input-len", "0"], "--input-len: must be >= 1, got 0"),
        (serve.build_parser, ["--output-len", "0"], "--output-len: must be >= 1, got 0"),
    ],
)
def test_counts_that_cannot_run_are_argparse_errors(parser, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--samples", "0"], "samples and lengths must be >= 1"),
        (["--tasks", ","], "tasks: the list is empty"),
        (["--methods", ""], "methods: the list is empty"),
        (["--ratios", ""], "ratios: the list is empty"),
    ],
)
def test_eval_grid_takes_a_given_flag_even_when_empty(argv, message):
    args = eval_main.build_parser().parse_args(argv)
    with pytest.raises(ValueError, match=message):
        eval_main.resolve_grid(args)


def test_eval_grid_fills_absent_flags_from_the_preset():
    grid = eval_main.resolve_grid(eval_main.build_parser().parse_args(["--quick"]))
    assert grid["samples"] >= 1 and grid["tasks"] and grid["methods"] and grid["ratios"]
