"""Write ``docs/results/index.md``: one row per committed report, with its machine and commit.

``python -m sparsekv.bench.results_index [DIR]`` (``make results-index``) reads every report
under ``DIR`` (default ``docs/results``): each JSON file with a ``provenance`` object, and each
Markdown report with a ``## Provenance`` section that has no JSON twin. A row names the report,
its title, date, commit (short SHA, ``+dirty`` when the tree had changes), CPU (model, core
generation where recorded, and the kernel-relevant flags), threads, and the command that
reproduces it: the report's own ``provenance.command`` where it records one, else the entry of
:data:`COMMANDS`. ``--check`` exits 1 when the committed index differs from what would be written
(a test runs it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DEFAULT_DIR = Path("docs/results")
INDEX_NAME = "index.md"
FLAG_NAMES = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"))

_SWEEP = (
    "sparsekv bench sweep --kv-cache-memory 1 --configs 'full:--kv-compression none' "
    "'snapkv512:--kv-compression snapkv --kv-budget 512 --kv-full-layers 2' "
    "'pyramidkv512:--kv-compression pyramidkv --kv-budget 512 --kv-full-layers 2'"
)
_S1 = (
    "sparsekv bench throughput --input-len 2000 --output-len 128 --num-prompts 16 "
    "--hf-baseline --single-ttft 4000 --decode-batch1"
)
_PREFIX = (
    "sparsekv bench sweep --dataset shared-prefix --input-len 3100 --prefix-len 3000 "
    "--output-len 64 --concurrency 8 --num-prompts-per-level 32"
)
# Report path (relative to the results folder, without suffix) -> the command that made it.
COMMANDS = {
    "routing_shared_prefix": "sparsekv bench sweep --configs "
    "'prefix:--data-parallel-size 2 --threads-per-rank 1 --routing-policy prefix' "
    "'round_robin:--data-parallel-size 2 --threads-per-rank 1 --routing-policy round_robin' "
    "--server-args '--kv-compression none' --dataset shared-prefix --input-len 1600 "
    "--prefix-len 1536 --num-prefixes 7 --output-len 32 --concurrency 4 "
    "--num-prompts-per-level 35 --kv-cache-memory 0.5",
    "compare_decode": "sparsekv bench decode-compare --threads 2 "
    '--llama-bench "$(scripts/build_llama_bench.sh)"',
    "s1": _S1,
    "s1_second_run": _S1,
    "s1_third_run": _S1,
    "s1_fourth_run": _S1,
    "s1_fifth_run": _S1,
    "s2": "sparsekv bench compression --methods snapkv,pyramidkv",
    "sweep_full/sweep": _SWEEP + " --external vllm=http://127.0.0.1:8100",
    "sweep_quick_sparsekv": _SWEEP.replace("sweep ", "sweep --quick ", 1),
    "sweep_quick_vllm": "sparsekv bench sweep --quick --configs --external vllm=URL",
    "sweep_sparsekv": _SWEEP.replace(
        "sweep ",
        "sweep --concurrency 1 5 --num-prompts-per-level 5 --input-len 4000 --output-len 128 ",
        1,
    ),
    "sweep_vllm": "sparsekv bench sweep --concurrency 1 5 --num-prompts-per-level 5 "
    "--input-len 4000 --output-len 128 --configs --external vllm=URL",
    "prefix_sweep": _PREFIX + " --configs 'full+cache:--kv-compression none' "
    "'full-nocache:--kv-compression none --no-enable-prefix-caching' "
    "'snapkv512+cache:--kv-compression snapkv --kv-budget 512 --prefix-cache-uncompressed' "
    "'snapkv512-nocache:--kv-compression snapkv --kv-budget 512 --no-enable-prefix-caching'",
    "context_scope_context": _PREFIX + " --configs 'snapkv512-context:--kv-compression snapkv "
    '--kv-budget 512\' --extra-body \'{"kv_compression": {"scope": "context", '
    '"context_tokens": 3000}}\'',
    "context_scope_prompt": _PREFIX + " --configs 'snapkv512-prompt:--kv-compression snapkv "
    "--kv-budget 512'",
    "context_scope_full_cache": _PREFIX + " --configs 'full+cache:--kv-compression none'",
    "fidelity": "sparsekv bench fidelity --threads 1",
    "kv_quant": "sparsekv bench kv-quant --threads 1",
    "kernels": "sparsekv bench kernels",
    "kernels_bf16": "sparsekv bench kernels --dtypes bf16 --no-reference",
    "roofline": "sparsekv bench roofline --batch 1 16 --context 2000 --kv-compression none",
    "gemma_paging_8k": "sparsekv bench gemma-paging --model gemma3-270m --num-requests 8 "
    "--input-len 8192 --output-len 128",
    "gemma_passkey_16k": "sparsekv bench gemma-paging --model gemma3-270m --num-requests 1 "
    "--input-len 1024 --output-len 8 --passkey-length 16384 --threads 1",
    "eval_gemma3": "sparsekv eval --model gemma3-270m --dtype bfloat16 --prompt-format completion "
    "--tasks passkey,niah_single --lengths 4096,8192,16384 "
    "--methods none,snapkv,pyramidkv,streaming_llm --ratios 0.5,0.75,0.9 --samples 2 --threads 1 "
    "--kv-cache-memory 1",
    "eval_gemma3_grid5/eval": "sparsekv eval --model gemma3-270m --dtype bfloat16 "
    "--prompt-format completion --tasks passkey,niah_single,niah_multikey,vt,fwe "
    "--lengths 4096,8192,16384 --methods none,snapkv,pyramidkv,streaming_llm "
    "--ratios 0.5,0.75,0.9 --samples 5 --threads 2 --kv-cache-memory 1",
}
_PASSKEY = (
    "sparsekv eval --tasks passkey --lengths 900 --samples 10 --methods none,snapkv "
    "--prompt-format chat-plain --kv-scope prompt --threads 1 "
)
# The measurements behind the default SnapKV settings (docs/compression.md).
COMMANDS.update(
    {
        f"defaults_zen4/passkey_{name}/eval": _PASSKEY + flags
        for name, flags in {
            "k7": "--ratios 0.75 --kv-kernel-size 7",
            "k11": "--ratios 0.75 --kv-kernel-size 11",
            "k15": "--ratios 0.75 --kv-kernel-size 15",
            "k21": "--ratios 0.75 --kv-kernel-size 21",
            "k15w64": "--ratios 0.75 --kv-kernel-size 15 --kv-window 64",
            "k15avg": "--ratios 0.75 --kv-kernel-size 15 --kv-pooling avg",
            "r90k7": "--ratios 0.9 --kv-kernel-size 7",
            "r90k15": "--ratios 0.9 --kv-kernel-size 15",
        }.items()
    }
)
COMMANDS.update(
    {
        f"defaults_zen4/fidelity_k{k}": "sparsekv bench fidelity --methods snapkv --ratios "
        f"0.75,0.9 --num-texts 8 --kv-kernel-size {k} --threads 1"
        for k in (7, 15)
    }
)
COMMANDS["ruler_gemma3_4k/ruler"] = (
    "sparsekv eval --suite ruler --model gemma3-270m --prompt-format completion --samples 20 "
    "--methods 'none,snapkv,snapkv:kernel_size=15,expected_attention' --ratios 0.75 "
    "--protocol both --share-group 1 --kv-cache-memory 1 --threads 1 (default kernel then 7)"
)


def markdown_provenance(text: str) -> dict | None:
    """The ``- key: `json``` lines of a Markdown report's ``## Provenance`` section."""
    if "## Provenance" not in text:
        return None
    section = text.split("## Provenance", 1)[1]
    values = {}
    for key, raw in re.findall(r"^- (\w+): `(.*)`$", section, flags=re.MULTILINE):
        try:
            values[key] = json.loads(raw)
        except json.JSONDecodeError:
            values[key] = raw
    return values


def _title(path: Path, data: dict) -> str:
    if isinstance(data.get("title"), str):
        return data["title"]
    twin = path.with_suffix(".md")
    if twin.is_file():
        first = twin.read_text(encoding="utf-8").splitlines()[:1]
        if first and first[0].startswith("# "):
            return first[0][2:].strip()
    return path.stem.replace("_", " ")


def _cpu(provenance: dict) -> str:
    cpu = provenance.get("cpu")
    flags: set[str] = set(provenance.get("cpu_flags") or [])
    model = ""
    if isinstance(cpu, dict):
        model = " ".join(str(cpu.get(key) or "") for key in ("model", "generation"))
        flags |= {name for name, on in (cpu.get("flags") or {}).items() if on}
    elif isinstance(cpu, str) and cpu != "x86_64":
        model = cpu
    best = next((label for flag, label in FLAG_NAMES if flag in flags), "AVX2" if flags else "")
    model = model.replace("(R)", "").replace("  ", " ").strip()
    return ", ".join(part for part in (model, best) if part) or "not recorded"


def report_row(root: Path, path: Path, provenance: dict, data: dict) -> dict[str, str]:
    """One index row (strings) for the report at ``path`` under ``root``."""
    key = path.relative_to(root).with_suffix("").as_posix()
    sha = str(provenance.get("git_sha") or "")
    commit = (sha[:7] + ("+dirty" if provenance.get("git_dirty") else "")) if sha else "?"
    threads = provenance.get("num_threads", provenance.get("threads"))
    date = str(provenance.get("date") or "")[:16].replace("T", " ")
    links = [f"[{path.suffix[1:]}]({path.relative_to(root).as_posix()})"]
    twin = path.with_suffix(".md")
    if path.suffix == ".json" and twin.is_file():
        links.append(f"[md]({twin.relative_to(root).as_posix()})")
    command = provenance.get("command") or COMMANDS.get(key, "")
    return {
        "report": " ".join(links),
        "title": _title(path, data).replace("|", "/"),
        "date (UTC)": date or "not recorded",
        "commit": f"`{commit}`",
        "machine": _cpu(provenance),
        "threads": str(threads) if threads else "?",
        "command": f"`{command}`" if command else "",
    }


def collect(root: Path) -> list[dict[str, str]]:
    """Every report under ``root``, sorted by path."""
    rows = []
    for path in sorted(root.rglob("*")):
        if path.name == INDEX_NAME or path.suffix not in (".json", ".md"):
            continue
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            provenance = data.get("provenance") if isinstance(data, dict) else None
        else:
            if path.with_suffix(".json").is_file():
                continue  # the JSON twin is the report; its row links this file
            data = {}
            provenance = markdown_provenance(path.read_text(encoding="utf-8"))
        if isinstance(provenance, dict):
            rows.append(report_row(root, path, provenance, data))
    return rows


def render(rows: list[dict[str, str]]) -> str:
    """The index page's Markdown."""
    lines = [
        "# Results index",
        "",
        "Generated by `make results-index` (`python -m sparsekv.bench.results_index`) from the",
        "reports in this folder; do not edit by hand. Machine = CPU model and its widest kernel",
        "ISA (AMX > AVX512-BF16 > AVX-512 > AVX2); commands run from the repository root with",
        "`.venv/bin/` in front. What the figures mean: [../benchmarks.md](../benchmarks.md).",
        "",
    ]
    if rows:
        header = list(rows[0])
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the index; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m sparsekv.bench.results_index")
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--check", action="store_true", help="exit 1 if the index is stale")
    args = parser.parse_args(argv)
    text = render(collect(args.directory))
    index = args.directory / INDEX_NAME
    if args.check:
        current = index.read_text(encoding="utf-8") if index.is_file() else ""
        if current != text:
            print(f"{index} is stale: run `make results-index`", file=sys.stderr)
            return 1
        return 0
    index.write_text(text, encoding="utf-8")
    print(f"wrote {index} ({text.count(chr(10)) - 9} reports)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
