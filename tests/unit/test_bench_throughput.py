"""``sparsekv bench throughput`` end to end on a tiny random Llama (no timing asserts)."""

from __future__ import annotations

import json

import pytest
import torch

from sparsekv.bench import throughput
from tests.conftest import tiny_checkpoint, tiny_llama_config


@pytest.fixture(autouse=True)
def restore_threads():
    """The commands run with ``--threads 1`` (tiny ops); give the session its count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(smollm2_tokenizer):
    return tiny_checkpoint(tiny_llama_config(), smollm2_tokenizer, seed=11)[0]


def _run(tmp_path, checkpoint, *flags):
    out = tmp_path / "throughput.json"
    argv = [
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--kv-cache-memory",
        "0.05",
        "--output",
        str(out),
        *flags,
    ]
    assert throughput.main(argv, checkpoint=checkpoint) == 0
    return json.loads(out.read_text()), out


def test_full_cache_batch_hf_baseline_single_ttft_and_decode(tmp_path, checkpoint):
    document, out = _run(
        tmp_path,
        checkpoint,
        *("--input-len", "24", "--output-len", "5", "--num-prompts", "3"),
        *("--kv-compression", "none", "--hf-baseline"),
        *("--single-ttft", "40", "--decode-batch1", "--decode-input-len", "16"),
    )
    batch = document["batch"]
    assert batch["output_tokens"] == 3 * 5
    assert batch["prompt_tokens"] == 3 * 24
    assert len(batch["ttft_s"]) == 3 and all(t > 0 for t in batch["ttft_s"])
    assert batch["output_tok_s"] > 0 and batch["total_tok_s"] > batch["output_tok_s"]
    assert 0 < batch["peak_pages_used"] <= batch["pages_total"]
    # 0, or 1/29 where the last generated token (never cached) counts in num_tokens.
    assert batch["compression_ratio_mean"] <= 1 / 29 + 1e-9
    assert document["hf"]["output_tokens"] == 3 * 5
    assert document["hf_speed_ratio"] > 0
    assert [row["system"] for row in document["rows"]] == ["sparsekv", "hf-transformers"]
    assert document["single_ttft"]["input_len"] == 40
    assert document["single_ttft"]["ttft_s"] > 0
    assert document["decode_batch1"]["output_tokens"] == 5
    assert document["decode_batch1"]["decode_tok_s"] > 0
    provenance = document["provenance"]
    assert {"git_sha", "torch_version", "cpu", "load_average_start", "config"} <= set(provenance)
    assert provenance["dtype_resolved"] == "float32"
    assert out.with_suffix(".md").exists()


def test_compressed_batch_reports_its_ratio(tmp_path, checkpoint):
    document, _ = _run(
        tmp_path,
        checkpoint,
        *("--input-len", "64", "--output-len", "4", "--num-prompts", "2"),
        *("--kv-compression", "snapkv", "--kv-budget", "24", "--kv-window", "8"),
        *("--kv-full-layers", "1", "--no-warmup"),
    )
    batch = document["batch"]
    assert batch["output_tokens"] == 2 * 4
    assert 0 < batch["compression_ratio_mean"] < 1
    assert "hf" not in document and "single_ttft" not in document


def test_single_request_figures_alone_print_no_empty_table(tmp_path, checkpoint, capsys):
    document, _ = _run(
        tmp_path,
        checkpoint,
        *("--num-prompts", "0", "--single-ttft", "30", "--decode-batch1"),
        *("--decode-input-len", "16", "--output-len", "4"),
    )
    assert document["rows"] == [] and "batch" not in document
    assert document["single_ttft"]["ttft_s"] > 0
    printed = capsys.readouterr().out
    assert "output_tok_s" not in printed  # no header without rows
    assert "single TTFT, 30 tokens:" in printed and "wrote " in printed
