"""Report writer, heatmap and provenance."""

from __future__ import annotations

import json
import math

import pytest

from sparsekv.bench import results_index
from sparsekv.evaluation import provenance as provenance_module
from sparsekv.evaluation.report import (
    heatmap_grid,
    markdown_table,
    provenance,
    write_heatmap,
    write_report,
)

PROVENANCE_KEYS = {
    "git_sha",
    "torch_version",
    "transformers_version",
    "num_threads",
    "cpu",
    "python_version",
    "date",
    "config",
}
ROWS = [
    {"method": "snapkv", "ratio": 0.5, "agreement": 0.91},
    {"method": "snapkv", "ratio": 0.25, "agreement": 0.97},
    {"method": "h2o", "ratio": 0.5, "agreement": 0.84},
    {"method": "h2o", "ratio": 0.25, "agreement": 0.93},
]


def is_png(path) -> bool:
    data = path.read_bytes()
    return data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_write_report_writes_three_files(tmp_path):
    prov = provenance({"model": "smollm2-135m-instruct", "budget": 256})
    files = write_report(
        tmp_path / "out",
        "fidelity",
        ROWS,
        title="Fidelity",
        x="ratio",
        y="agreement",
        group="method",
        provenance=prov,
    )
    document = json.loads(files.json.read_text())
    assert document["rows"] == ROWS
    assert PROVENANCE_KEYS <= set(document["provenance"])
    assert document["provenance"]["config"] == {"model": "smollm2-135m-instruct", "budget": 256}
    markdown = files.markdown.read_text()
    assert "| method | ratio | agreement |" in markdown
    assert "| h2o | 0.25 | 0.93 |" in markdown
    assert "git_sha" in markdown
    assert is_png(files.png)


def test_write_report_single_line_and_errors(tmp_path):
    files = write_report(
        tmp_path, "one", ROWS[:2], title="t", x="ratio", y="agreement", provenance={}
    )
    assert is_png(files.png)
    with pytest.raises(ValueError, match="lack"):
        write_report(
            tmp_path, "bad", [{"ratio": 1}], title="t", x="ratio", y="agreement", provenance={}
        )
    with pytest.raises(ValueError, match="at least one row"):
        write_report(tmp_path, "bad", [], title="t", x="a", y="b", provenance={})


def test_markdown_table_unions_columns():
    table = markdown_table([{"a": 1}, {"b": 2.123456, "a": None}])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 |  |", "|  | 2.123 |"]


def test_heatmap_grid_averages_cells(tmp_path):
    rows = [
        {"length": 4000, "depth": 0.0, "score": 100.0},
        {"length": 4000, "depth": 0.0, "score": 50.0},
        {"length": 8000, "depth": 0.0, "score": 0.0},
        {"length": 4000, "depth": 1.0, "score": 100.0},
    ]
    xs, ys, grid = heatmap_grid(rows)
    assert xs == [4000, 8000] and ys == [0.0, 1.0]
    assert grid[0] == [75.0, 0.0]
    assert grid[1][0] == 100.0 and math.isnan(grid[1][1])
    assert is_png(write_heatmap(tmp_path / "h" / "grid.png", rows, title="passkey"))


def test_provenance_names_the_checkout_as_first_asked(tmp_path, monkeypatch):
    # A long run's report must name the code it started with, not a tree edited meanwhile.
    monkeypatch.setattr(provenance_module, "_REPO_ROOT", tmp_path)
    calls = []

    def fake_git(*args, root=None):
        calls.append(args)
        return "a" * 40 if args[0] == "rev-parse" else ""

    monkeypatch.setattr(provenance_module, "_git", fake_git)
    assert provenance_module.code_version() == ("a" * 40, False)
    monkeypatch.setattr(provenance_module, "_git", lambda *args, root=None: "b" * 40)
    prov = provenance()
    assert prov["git_sha"] == "a" * 40 and prov["git_dirty"] is False
    assert len(calls) == 2


def test_provenance_records_the_command_line():
    assert provenance_module.command_line(
        ["/x/.venv/bin/sparsekv", "eval", "--methods", "a,b c"]
    ) == ("sparsekv eval --methods 'a,b c'")
    assert provenance_module.command_line(["/x/sparsekv/__main__.py", "env"]) == "sparsekv env"
    assert provenance_module.command_line(["scripts/tool.py", "--n", "2"]) == "tool.py --n 2"
    assert provenance_module.command_line([""]) is None
    assert (
        provenance_module.command_line(
            ["sparsekv", "bench", "--api-key", "s3", "--hf-token=t", "--max-tokens", "8"]
        )
        == "sparsekv bench --api-key '***' '--hf-token=***' --max-tokens 8"
    )
    assert provenance()["command"] == provenance_module.command_line()


def test_provenance_without_git_and_cpu_flags(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance_module, "_REPO_ROOT", tmp_path)
    prov = provenance()
    assert prov["git_sha"] is None and prov["config"] is None
    assert prov["num_threads"] >= 1
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Test CPU\nflags\t\t: fpu avx2 avx512f amx_tile\n")
    info = provenance_module.cpu_info(str(cpuinfo))
    assert info["model"] == "Test CPU"
    assert info["flags"] == {
        "avx2": True,
        "avx512f": True,
        "avx512_bf16": False,
        "avx512_vnni": False,
        "avx_vnni": False,
        "amx_bf16": False,
        "amx_int8": False,
        "amx_tile": True,
    }
    assert info["family"] is None and info["generation"] is None


@pytest.mark.parametrize(
    "vendor, family, model, flags, generation",
    [
        ("AuthenticAMD", 26, 2, "avx2 avx512f avx_vnni", "Zen 5"),
        ("AuthenticAMD", 25, 17, "avx2 avx512f avx512_bf16", "Zen 4"),
        ("AuthenticAMD", 25, 1, "avx2", None),  # Zen 3: no AVX-512
        ("GenuineIntel", 6, 143, "avx2 avx512f amx_tile", "Sapphire Rapids"),
        ("GenuineIntel", 6, 207, "avx2 avx512f amx_tile", "Emerald Rapids"),
        ("GenuineIntel", 6, 2, "avx2", None),  # a model number not in the table
        ("GenuineIntel", 15, 207, "avx2", None),  # not family 6
    ],
)
def test_cpu_info_names_the_core_generation(tmp_path, vendor, family, model, flags, generation):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        f"vendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        f"model name\t: EPYC or Xeon\nflags\t\t: {flags}\n"
    )
    info = provenance_module.cpu_info(str(cpuinfo))
    assert (info["vendor"], info["family"], info["model_number"]) == (vendor, family, model)
    assert info["generation"] == generation


@pytest.mark.parametrize(
    "cpu, machine",
    [
        (
            {"model": "Intel(R) Xeon(R) Processor", "generation": "Emerald Rapids",
             "flags": {"amx_bf16": True, "avx512_bf16": True}},
            "Intel Xeon Processor Emerald Rapids, AMX",
        ),
        (
            {"model": "AMD EPYC", "generation": "Zen 5",
             "flags": {"amx_bf16": False, "avx512_bf16": True}},
            "AMD EPYC Zen 5, AVX512-BF16",
        ),
        ({"model": "AMD EPYC", "flags": {"avx2": True}}, "AMD EPYC, AVX2"),  # older reports
    ],
)  # fmt: skip
def test_results_index_names_the_machine_with_its_generation(tmp_path, cpu, machine):
    row = results_index.report_row(tmp_path, tmp_path / "r.json", {"cpu": cpu}, {})
    assert row["machine"] == machine


def test_provenance_records_the_kernel_environment(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("SPARSEKV_KERNEL_ISA", "avx2")
    monkeypatch.setenv("SPARSEKV_API_KEY", "s3cret")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    environment = provenance_module.provenance()["environment"]
    assert environment["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert environment["SPARSEKV_KERNEL_ISA"] == "avx2"
    assert environment["SPARSEKV_API_KEY"] == "<hidden>"
    assert "UNRELATED_SETTING" not in environment
    assert list(environment) == sorted(environment)
