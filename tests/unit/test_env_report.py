"""``sparsekv env``: the report a user runs first and pastes into a bug report (versions, CPU,
kernel variants as ``bench kernels --list`` prints them, caches, environment), as text and as
JSON, through the CLI's main function."""

from __future__ import annotations

import json
import os
import platform

import pytest
import torch
import transformers

import sparsekv
from sparsekv import cli, env_report
from sparsekv.bench.kernels import variants
from sparsekv.evaluation import ruler_data
from sparsekv.evaluation.provenance import cpu_info
from sparsekv.loader.cache import cache_root

KEYS = {"versions", "cpu", "kernels", "native_extensions", "caches", "environment"}


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # noqa: BLE001 - as env_report reads it
        return None
    return triton.__version__


@pytest.fixture
def marked_env(monkeypatch):
    """Variables that change nothing here but must be listed (the key one hidden)."""
    monkeypatch.setenv("SPARSEKV_ENV_REPORT_TEST", "on")
    monkeypatch.setenv("SPARSEKV_API_KEY", "do-not-print")
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))


def test_json_through_the_cli(capsys, marked_env):
    assert cli.main(["env", "--json"]) == 0
    out = capsys.readouterr().out
    document = json.loads(out)  # stdout holds the one object and nothing else
    assert set(document) == KEYS
    v = document["versions"]
    assert v["sparsekv"] == sparsekv.__version__
    assert v["python"] == platform.python_version()
    assert v["torch"] == torch.__version__
    assert v["transformers"] == transformers.__version__
    assert v["triton"] == _triton_version()
    assert v["cuda"]["available"] == torch.cuda.is_available()
    assert len(v["cuda"]["devices"]) == torch.cuda.device_count()

    assert document["kernels"] == variants.variant_lines()
    assert document["kernels"][0].startswith("CPU features: ")

    c = document["cpu"]
    assert {k: c[k] for k in cpu_info()} == cpu_info()
    assert c["torch_threads"] == torch.get_num_threads()
    assert c["cores"] == os.cpu_count()
    assert 1 <= c["usable_cores"] <= c["cores"]

    assert [e["name"] for e in document["native_extensions"]] == [
        "sparsekv_cpu_kernels", "sparsekv_fused_ops", "sparsekv_quant_ops",
    ]  # fmt: skip
    caches = document["caches"]
    assert {k: e["env"] for k, e in caches.items()} == {
        "native_kernels": "SPARSEKV_EXT_DIR",
        "loader": "SPARSEKV_CACHE_DIR",
        "ruler_data": "SPARSEKV_CACHE_DIR",
    }
    assert caches["loader"]["path"] == str(cache_root())
    assert caches["ruler_data"]["path"] == str(ruler_data.cache_dir())
    for ext in document["native_extensions"]:
        assert os.path.dirname(ext["directory"]) == caches["native_kernels"]["path"]

    env = document["environment"]
    assert env["SPARSEKV_ENV_REPORT_TEST"] == "on"
    assert env["SPARSEKV_API_KEY"] == "<hidden>"
    assert env["OMP_NUM_THREADS"] == str(torch.get_num_threads())
    assert "do-not-print" not in out
    assert all(name.startswith(("SPARSEKV_", "ATEN_", "ONEDNN_", "DNNL_", "MKL_", "OMP_"))
               for name in env)  # fmt: skip


def test_text_through_the_cli(capsys, marked_env):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert f"torch         {torch.__version__} (" in out
    assert f"transformers  {transformers.__version__}" in lines
    kernel_lines = variants.variant_lines()
    start = lines.index(kernel_lines[0])
    assert lines[start : start + len(kernel_lines)] == kernel_lines  # verbatim, in order
    for name in ("SPARSEKV_EXT_DIR", "SPARSEKV_CACHE_DIR"):
        assert f"(set {name} to move)" in out
    assert "(set SPARSEKV_CACHE to move)" not in out  # deprecated: not recommended
    assert "  SPARSEKV_ENV_REPORT_TEST=on" in lines
    assert "  SPARSEKV_API_KEY=<hidden>" in lines
    assert "do-not-print" not in out


def test_cache_folders_follow_their_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEKV_EXT_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "loader"))
    monkeypatch.delenv("SPARSEKV_CACHE", raising=False)
    found = env_report.caches()
    assert found["native_kernels"]["path"] == str(tmp_path / "ext")
    assert found["loader"]["path"] == str(tmp_path / "loader")
    assert found["ruler_data"]["path"] == str(tmp_path / "loader" / "ruler")
    extensions = env_report.native_extensions()
    assert all(not e["built"] for e in extensions)  # nothing was built in tmp_path
    assert all(e["directory"].startswith(str(tmp_path / "ext")) for e in extensions)
    assert not list(tmp_path.iterdir())  # asking builds nothing and creates no folder


def test_the_kernel_folder_follows_the_cache_root_unless_moved_alone(monkeypatch, tmp_path):
    monkeypatch.delenv("SPARSEKV_EXT_DIR", raising=False)
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "root"))
    assert env_report.caches()["native_kernels"]["path"] == str(tmp_path / "root" / "ext")
    monkeypatch.delenv("SPARSEKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env_report.caches()["native_kernels"]["path"] == str(
        tmp_path / "xdg" / "sparsekv" / "ext"
    )
    monkeypatch.setenv("SPARSEKV_EXT_DIR", str(tmp_path / "alone"))
    assert env_report.caches()["native_kernels"]["path"] == str(tmp_path / "alone")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("built", [True, False])
def test_a_build_is_announced_on_stderr_first(monkeypatch, capsys, built):
    rows = [{"name": "x", "directory": "/d/x", "built": built, "disabled": False}]
    monkeypatch.setattr(env_report, "native_extensions", lambda: rows)

    def lines():
        assert (env_report.BUILD_NOTICE in capsys.readouterr().err) != built  # said before
        return ["CPU features: avx2"]

    monkeypatch.setattr(variants, "variant_lines", lines)
    assert env_report.report()["kernels"] == ["CPU features: avx2"]


def test_a_disabled_extension_is_not_announced(monkeypatch, capsys):
    rows = [{"name": "x", "directory": "/d/x", "built": False, "disabled": True}]
    monkeypatch.setattr(env_report, "native_extensions", lambda: rows)
    monkeypatch.setattr(variants, "variant_lines", lambda: [])
    env_report.report()
    assert env_report.BUILD_NOTICE not in capsys.readouterr().err


def test_render_names_cuda_devices_and_an_empty_environment():
    document = {
        "versions": {
            "sparsekv": "0.1.0", "python": "3.11.7", "torch": "2.6.0+cu124",
            "cuda": {"available": True, "version": "12.4", "devices": ["NVIDIA H100 80GB HBM3"]},
            "transformers": None, "triton": "3.2.0",
        },
        "cpu": {
            "model": "Intel(R) Xeon(R) Processor", "vendor": "GenuineIntel", "family": 6,
            "model_number": 143, "generation": "Sapphire Rapids",
            "flags": {"avx2": True, "amx_bf16": True, "avx_vnni": False},
            "cores": 8, "usable_cores": 4, "torch_threads": 4,
        },
        "kernels": ["CPU features: avx2", "decode       avx2 (the fastest this CPU runs)"],
        "native_extensions": [
            {"name": "sparsekv_cpu_kernels", "directory": "/c/ext/t", "built": False,
             "disabled": True},
        ],
        "caches": {"native_kernels": {"path": "/c/ext", "env": "SPARSEKV_EXT_DIR"}},
        "environment": {},
    }  # fmt: skip
    lines = env_report.render(document)
    assert "torch         2.6.0+cu124 (CUDA 12.4: NVIDIA H100 80GB HBM3)" in lines
    assert "transformers  not installed" in lines
    assert "              GenuineIntel, family 6, model 143 (Sapphire Rapids)" in lines
    assert "flags         avx2 amx_bf16" in lines
    assert "cores         8 (4 usable here); torch intra-op threads 4" in lines
    assert lines[lines.index("CPU features: avx2") + 1].startswith("decode       avx2")
    assert "    sparsekv_cpu_kernels  disabled  /c/ext/t" in lines
    assert lines[-1].startswith("  (none of SPARSEKV_*")
