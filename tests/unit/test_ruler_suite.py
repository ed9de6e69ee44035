"""The official RULER suite: the adapter reproduces the package's own samples and scores them
as RULER does; aggregates; ``sparsekv eval --suite ruler`` end to end on a tiny random Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from long_context_eval.eval.synthetic import constants as ruler_metrics

from sparsekv.config import CompressionConfig
from sparsekv.evaluation import main as eval_main
from sparsekv.evaluation import (
    ruler_data,
    ruler_main,
    ruler_run,
    ruler_stats,
    ruler_tasks,
    runner,
)
from sparsekv.evaluation.scoring import score
from tests.conftest import tiny_checkpoint, tiny_llama_config


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Generated samples and punkt tables go to this test's folder (no cached rows reused)."""
    monkeypatch.setattr(ruler_data, "cache_dir", lambda: tmp_path / "cache")


def package_prepare(tmp_path: Path, tokenizer, task: str, length: int, num_samples: int):
    """The package's own ``prepare.py`` for ``task`` (its shell runs ``python``: ours)."""
    env = ruler_data.generator_env(ruler_data.punkt_data_dir())
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    out = tmp_path / "prepared"
    script = ruler_data.package_root() / "data" / "prepare.py"
    command = [sys.executable, str(script), "--save_dir", str(out), "--task", task]
    command += ["--tokenizer_path", str(ruler_data.tokenizer_dir(tokenizer))]
    command += ["--tokenizer_type", "hf", "--max_seq_length", str(length)]
    command += ["--num_samples", str(num_samples)]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=1200)
    lines = (out / task / "validation.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def assert_same_samples(tmp_path, tokenizer, name, length, num_samples=2):
    task = ruler_tasks.load_tasks()[name]
    ours = ruler_tasks.generate(task, tokenizer, length, num_samples, seed=42)
    theirs = package_prepare(tmp_path, tokenizer, name, length, num_samples)
    assert len(ours) == len(theirs) == num_samples
    for sample, row in zip(ours, theirs):
        assert sample.text == row["input"]
        assert sample.answers == row["outputs"]
        assert sample.length == row["length"] <= length
        assert sample.question.startswith(task.question_marker)
        assert sample.answer_prefix.startswith(task.answer_marker)


@pytest.mark.parametrize("name", ["vt", "cwe"])
def test_adapter_produces_the_packages_own_samples(tmp_path, smollm2_tokenizer, name):
    assert_same_samples(tmp_path, smollm2_tokenizer, name, 1024)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,length",
    [("niah_single_1", 1024), ("niah_single_2", 1024), ("niah_multikey_2", 1024),
     ("fwe", 1024), ("qa_1", 2048)],
)  # fmt: skip
def test_adapter_produces_the_packages_own_samples_for_every_kind(
    tmp_path, smollm2_tokenizer, name, length
):
    assert_same_samples(tmp_path, smollm2_tokenizer, name, length)


def test_task_table_is_the_packages():
    tasks = ruler_tasks.load_tasks()
    assert len(tasks) == 13
    assert [t.metric for t in tasks.values()].count("part") == 2
    assert tasks["qa_2"].metric == "part" and tasks["qa_2"].args == {"dataset": "hotpotqa"}
    generate = {name: task.tokens_to_generate for name, task in tasks.items()}
    assert generate["niah_multivalue"] == 128 and generate["vt"] == 30
    assert generate["cwe"] == 120 and generate["fwe"] == 50 and generate["qa_1"] == 32
    assert tasks["niah_single_3"].args["type_needle_v"] == "uuids"
    assert tasks["vt"].question_marker == "\nQuestion:"
    assert tasks["niah_single_1"].question_marker == "\nWhat"
    assert tasks["qa_1"].answer_marker == " Answer:"


def test_split_rejects_a_row_off_the_template():
    task = ruler_tasks.load_tasks()["vt"]
    with pytest.raises(ValueError, match="does not follow the task template"):
        ruler_tasks.split_sample(task, {"index": 0, "input": "no markers", "outputs": ["X"]})


def test_qa_below_its_minimum_length_is_refused(smollm2_tokenizer):
    task = ruler_tasks.load_tasks()["qa_1"]
    with pytest.raises(ValueError, match="qa tasks"):
        ruler_tasks.generate(task, smollm2_tokenizer, 1024, 1)


PREDICTIONS = [
    # task metric, prediction, references, RULER's score
    ("all", "The special magic number is 1234567.", ["1234567"], 100.0),
    ("all", "It is 7654321", ["1234567"], 0.0),
    ("all", "11, 33 and 44", ["11", "22", "33", "44"], 75.0),
    ("all", "variables: abcde, FGHIJ", ["ABCDE", "FGHIJ", "KLMNO"], 200 / 3),
    ("part", "It is PARIS, of course.", ["Paris", "Paris, France"], 100.0),
    ("part", "London", ["Paris", "Paris, France"], 0.0),
]


@pytest.mark.parametrize("metric,prediction,references,expected", PREDICTIONS)
def test_scores_are_rulers(metric, prediction, references, expected):
    ours = score(metric, prediction, references)
    ruler = {"all": ruler_metrics.string_match_all_per_sample,
             "part": ruler_metrics.string_match_part_per_sample}[metric]  # fmt: skip
    assert ours == pytest.approx(expected)
    assert ours == pytest.approx(ruler([prediction], [references])[0])


def test_macro_score_covers_the_tasks_the_full_cache_solves():
    def rows(task, method, scores):
        return [
            {"task": task, "length": 4096, "protocol": "aware", "method": method,
             "ratio": 0.0 if method == "none" else 0.75, "score": s, "compression_ratio": 0.0}
            for s in scores
        ]  # fmt: skip

    data = rows("a", "none", [100, 100]) + rows("a", "snapkv", [100, 0])
    data += rows("b", "none", [0, 50]) + rows("b", "snapkv", [0, 0])
    data += rows("c", "none", [40, 20]) + rows("c", "snapkv", [20, 20])
    summary = ruler_stats.task_summary(data)
    assert [(r["task"], r["method"], r["score"]) for r in summary] == [
        ("a", "none", 100), ("a", "snapkv", 50), ("b", "none", 25), ("b", "snapkv", 0),
        ("c", "none", 30), ("c", "snapkv", 20),
    ]  # fmt: skip
    assert summary[0]["ci_low"] == summary[0]["ci_high"] == 100
    assert 0 <= summary[1]["ci_low"] < 50 < summary[1]["ci_high"] <= 100
    solved = ruler_stats.solved_tasks(summary, 4096)
    assert solved == ["a", "c"]
    macro = {r["method"]: r for r in ruler_stats.macro_summary(data, solved, 4096)}
    assert macro["none"]["macro_score"] == 65 and macro["snapkv"]["macro_score"] == 35
    assert macro["snapkv"]["ci_low"] <= 35 <= macro["snapkv"]["ci_high"]


def test_bootstrap_needs_scores():
    with pytest.raises(ValueError, match="at least one"):
        ruler_stats.bootstrap_interval([])


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    return tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=3)[0]


def test_protocols_compress_the_prompt_or_the_context(smollm2_tokenizer):
    sample = ruler_tasks.RulerSample("vt", 0, "Memorize this. VAR A = 1.", "\nQuestion: A?",
                                     " Answer:", ["A"], 20)  # fmt: skip
    ids, num_context = ruler_run.prompt_ids(smollm2_tokenizer, sample, "completion")
    assert ids[:num_context] == smollm2_tokenizer(sample.context)["input_ids"]
    assert smollm2_tokenizer.decode(ids[num_context:]) == sample.question + sample.answer_prefix
    case = ruler_run.RulerCase(sample, "all", 1024, ids, num_context, 30)
    cell = runner.build_cells(["snapkv"], [0.75], CompressionConfig())[0]
    assert ruler_run.policy_of(cell, case, "aware") == cell.policy
    agnostic = ruler_run.policy_of(cell, case, "agnostic")
    assert (agnostic.scope, agnostic.context_tokens) == ("context", num_context)
    chat_ids, chat_context = ruler_run.prompt_ids(smollm2_tokenizer, sample, "chat")
    assert smollm2_tokenizer.decode(chat_ids[chat_context:]).startswith(sample.question)
    with pytest.raises(ValueError, match="protocol"):
        ruler_run.policy_of(cell, case, "both")


def test_eval_suite_ruler_end_to_end(tmp_path, tiny):
    before = torch.get_num_threads()
    argv = ["--suite", "ruler", "--tasks", "vt", "--lengths", "1024", "--samples", "1"]
    argv += ["--methods", "none,snapkv,expected_attention", "--ratios", "0.75"]
    argv += ["--kv-window", "8", "--kv-full-layers", "1", "--dtype", "float32", "--threads", "1"]
    argv += ["--kv-cache-memory", "0.05", "--no-progress", "--prompt-format", "completion"]
    argv += ["--output-dir", str(tmp_path / "out"), "--prefill-cost", "1"]
    try:
        assert eval_main.main(argv, checkpoint=tiny) == 0
    finally:
        torch.set_num_threads(before)
    result = json.loads((tmp_path / "out" / "ruler.json").read_text())
    cells = {(r["protocol"], r["method"]): r for r in result["tasks"]}
    assert set(cells) == {(p, m) for p in ("aware", "agnostic")
                          for m in ("none", "snapkv", "expected_attention")}  # fmt: skip
    assert all(r["num_samples"] == 1 and r["task"] == "vt" for r in cells.values())
    assert cells["aware", "none"]["compression_ratio"] == 0.0
    # Two of three layers compressed to a quarter: the whole prompt (aware) loses more than
    # the context alone (agnostic), which loses more than nothing.
    for method in ("snapkv", "expected_attention"):
        aware, agnostic = cells["aware", method], cells["agnostic", method]
        assert aware["compression_ratio"] > agnostic["compression_ratio"] > 0.3
    samples = json.loads((tmp_path / "out" / "ruler_samples.json").read_text())["rows"]
    assert len(samples) == 6
    # A random model solves nothing: the task is reported apart, no macro row.
    assert result["excluded"] == {"1024": ["vt"]} and result["macro"] == []
    assert "Left out of the macro score" in (tmp_path / "out" / "ruler.md").read_text()
    # One prefill serves the sample's 5 requests: each compressed one recomputes a tail only.
    prefill = result["provenance"]["prefill"]
    assert prefill["prefix_hit_tokens"] > 0
    assert 1 < prefill["prefills_per_sample"] < 1.5
    partial = (tmp_path / "out" / "ruler_partial.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["prediction"] for line in partial) == sorted(
        r["prediction"] for r in samples
    )
    ruler_main.report_partial(tmp_path / "out")
    again = json.loads((tmp_path / "out" / "partial" / "ruler.json").read_text())

    def by_cell(summary):
        return sorted(summary, key=lambda r: (r["protocol"], r["method"], r["ratio"]))

    assert by_cell(again["tasks"]) == by_cell(result["tasks"])
    # Prefill cost: every cell timed once, SnapKV at 1.0 of itself.
    cost = {(r["method"], r["protocol"]): r for r in result["prefill_cost"]}
    assert set(cost) == {("none", "both")} | {
        (m, p) for m in ("snapkv", "expected_attention") for p in ("aware", "agnostic")
    }
    assert all(r["prefill_s"] > 0 and r["num_runs"] == 1 for r in cost.values())
    assert cost["snapkv", "aware"]["vs_snapkv"] == 1.0


def test_without_the_ruler_package_the_cli_says_so_before_loading(monkeypatch, capsys):
    import importlib.util

    from sparsekv import cli
    from sparsekv.bench import common

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "long_context_eval" else real(name, *a),
    )

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the package check")

    monkeypatch.setattr(common, "load_checkpoint", no_model)
    assert cli.main(["eval", "--suite", "ruler", "--tasks", "vt", "--samples", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the RULER suite needs nvidia-long-context-eval: ")
    assert "Traceback" not in "\n".join(err)
