"""``sparsekv bench decode-compare`` end to end on a tiny GGUF file, with a stand-in llama-bench
(a script printing llama-bench's JSON) so that the report's arithmetic is checked exactly."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from sparsekv.bench import common, decode_compare
from sparsekv.bench.llama_bench import gguf_shape, run_llama_bench

GGUF = Path(__file__).parents[1] / "model" / "fixtures" / "gguf" / "llama3.gguf"
# The fixture: 2 layers, hidden 32, 4 heads (head_dim 8), 2 KV heads, MLP 48, vocab 320,
# untied head; its linear weights and embedding are F16, its norms and llama3 rope factors
# (head_dim / 2 values) F32.
LINEAR_PARAMS = 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 48 * 32) + 320 * 32
NORM_PARAMS = 2 * 2 * 32 + 32
ROPE_FACTORS = 4


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def fake_llama_bench(tmp_path: Path, samples: list[float]) -> Path:
    """An executable that appends its argv to ``argv.txt`` (a line per call) and prints one
    llama-bench JSON generation record."""
    record = {
        "model_type": "llama ?B F16",
        "n_prompt": 0,
        "n_gen": 4,
        "n_depth": 8,
        "type_k": "f16",
        "type_v": "f16",
        "avg_ts": sum(samples) / len(samples),
        "samples_ts": samples,
    }
    script = tmp_path / "llama-bench"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path / "argv.txt"}\n'
        f"cat <<'EOF'\n{json.dumps([record])}\nEOF\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_gguf_shape_counts_what_a_decode_step_reads():
    shape = gguf_shape(GGUF)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 8)
    # Untied head: the embedding is gathered, not read whole.
    assert shape.weight_bytes == 2 * LINEAR_PARAMS + 4 * (NORM_PARAMS + ROPE_FACTORS)
    assert shape.kv_bytes(10) == 2 * 2 * 2 * 8 * 2 * 10
    assert shape.kv_bytes(10, "q8_0") == pytest.approx(2 * 2 * 2 * 8 * 10 * 34 / 32)
    with pytest.raises(ValueError, match="cache_type"):
        shape.kv_bytes(10, "q3_k")


def test_run_llama_bench_passes_the_decode_flags_and_parses_json(tmp_path):
    binary = fake_llama_bench(tmp_path, [10.0, 12.0, 11.0])
    record = run_llama_bench(binary, GGUF, threads=2, context=512, output_len=128, repeats=3)
    assert record["samples_ts"] == [10.0, 12.0, 11.0]
    argv = (tmp_path / "argv.txt").read_text().split()
    assert argv == ["-m", str(GGUF), "-t", "2", "-p", "0", "-n", "128", "-d", "512"] + [
        "-r",
        "3",
        "-o",
        "json",
    ]
    with pytest.raises(FileNotFoundError, match="llama_bench"):
        run_llama_bench(tmp_path / "missing", GGUF, 2, 512, 128, 3)


def test_report_rows_and_bandwidth_fractions(tmp_path):
    binary = fake_llama_bench(tmp_path, [30.0, 50.0, 40.0])
    out = tmp_path / "compare.json"
    argv = ["--model", str(GGUF), "--llama-bench", str(binary), "--dtype", "float32"]
    argv += ["--context", "8", "--output-len", "4", "--repeats", "2", "--threads", "1"]
    argv += ["--weight-dtypes", "auto", "--kv-cache-memory", "0.01", "--probe-mib", "16"]
    argv += ["--output", str(out)]
    assert decode_compare.main(argv) == 0
    document = json.loads(out.read_text())
    bandwidth = document["read_bandwidth_gb_s"] * 1e9
    llama, ours = document["rows"]
    mean_context = 8 + 3 / 2
    # Two rounds, llama-bench once per round with one repetition.
    calls = (tmp_path / "argv.txt").read_text().splitlines()
    assert len(calls) == 2 and all(line.split()[-4:] == ["-r", "1", "-o", "json"] for line in calls)
    assert llama["samples_tok_s"] == [40.0, 40.0]  # each round's median
    assert llama["engine"] == "llama.cpp" and llama["decode_tok_s"] == 40.0
    assert llama["decode_tok_s_spread"] == 0.0
    paired = sorted(x / 40.0 for x in ours["samples_tok_s"])
    assert ours["vs_llama_cpp"] == pytest.approx(sum(paired) / 2)  # median of two rounds
    assert llama["kv_bytes"] == 2 * 2 * 2 * 8 * 2 * mean_context
    assert ours["engine"] == "sparsekv" and len(ours["samples_tok_s"]) == 2
    assert ours["weight_bytes"] == 4 * LINEAR_PARAMS  # fp32 dense linears, norms left out
    assert ours["kv_bytes"] == 2 * 2 * 2 * 8 * 4 * mean_context  # fp32 pages
    for row in (llama, ours):
        per_token = row["weight_bytes"] + row["kv_bytes"]
        assert row["bytes_per_token_mb"] == pytest.approx(per_token / 1e6)
        assert row["fraction"] == pytest.approx(row["decode_tok_s"] * per_token / bandwidth)
        assert row["bound_tok_s"] == pytest.approx(bandwidth / per_token)
    markdown = out.with_suffix(".md").read_text()
    assert "| llama.cpp |" in markdown and "| sparsekv |" in markdown
    assert "load_average_start" in markdown


def test_paired_ratio_is_the_median_of_per_round_ratios():
    assert common.paired_ratio([90.0, 60.0, 80.0], [100.0, 60.0, 100.0]) == 0.9
    with pytest.raises(ValueError, match="do not pair"):
        common.paired_ratio([1.0], [1.0, 2.0])


def test_rejects_bad_lengths(tmp_path):
    argv = ["--model", str(GGUF), "--output-len", "1", "--output", str(tmp_path / "x.json")]
    with pytest.raises(ValueError, match="output_len"):
        decode_compare.main(argv)
