"""The command line a person reads: help text, metavars, defaults, and clear errors for bad
input found before the model loads (no model is loaded here)."""

from __future__ import annotations

import argparse
import socket

import pytest

from sparsekv import cli
from sparsekv.cli_args import engine_config_from_args, field_docs, first_sentence
from sparsekv.config import CacheConfig, CompressionConfig
from sparsekv.sampling_params import SamplingParams


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_has_a_description_and_no_internal_metavar(command):
    parser = _subparser(command)
    for action in _options(parser):
        text = (action.help or "").split("(default:")[0].strip()
        assert text, f"{action.option_strings[0]} has no description"
        assert "__" not in str(action.metavar or ""), action.option_strings[0]
    help_text = parser.format_help()
    assert "__" not in help_text
    assert "(default: None)" not in help_text  # unset defaults are described in words


def test_engine_flags_show_their_real_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag: no wrapping inside a phrase
    help_text = " ".join(_subparser("serve").format_help().split())
    assert "--kv-budget N KV slots each budgeted layer keeps" in help_text
    assert "(default: 1024; replaced by --kv-compression-ratio)" in help_text
    assert "--kv-compression-ratio R fraction of the prompt's tokens removed" in help_text
    assert "--kv-cache-memory GIB GiB of KV memory" in help_text
    assert "(default: sized from the device; 2 GiB on CPU)" in help_text
    assert "--attention-backend {auto,cpu,torch,triton} attention kernels" in help_text
    assert "--gpu-memory-utilization FRACTION fraction of the device's memory" in help_text
    assert "--device auto|cpu|cuda[:N] torch device" in help_text
    assert "--port N TCP port (default: 8000)" in help_text
    assert "--enable-prefix-caching, --no-enable-prefix-caching share the KV pages" in help_text
    assert "(default: on)" in help_text and "(default: off)" in help_text
    assert "--kv-decode-eviction {on,off}" in help_text
    for title in ("server:", "model (", "cache (", "compression (", "scheduler ("):
        assert title in help_text


def test_help_follows_set_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    parser = argparse.ArgumentParser()
    cli.add_engine_args(parser)
    parser.set_defaults(compression__budget=512, scheduler__max_num_seqs=8)
    help_text = " ".join(parser.format_help().split())
    assert "(default: 512; replaced by --kv-compression-ratio)" in help_text
    assert "the most requests running at once. (default: 8)" in help_text


def test_field_docs_and_first_sentence():
    docs = field_docs(CacheConfig)
    assert set(docs) == {f for f in CacheConfig.__dataclass_fields__}
    assert docs["block_size"] == "token slots per KV page (a power of two)."
    assert first_sentence("keeps 1 e.g. 2. Then more.") == "keeps 1 e.g. 2."
    assert first_sentence("no stop here") == "no stop here"


def test_budget_and_ratio_flags():
    parser = argparse.ArgumentParser()
    cli.add_engine_args(parser)
    default = engine_config_from_args(parser.parse_args([])).compression
    assert (default.budget, default.compression_ratio) == (1024, None)
    ratio = engine_config_from_args(parser.parse_args(["--kv-compression-ratio", "0.75"]))
    assert (ratio.compression.budget, ratio.compression.compression_ratio) == (None, 0.75)
    budget = engine_config_from_args(parser.parse_args(["--kv-budget", "256"]))
    assert (budget.compression.budget, budget.compression.compression_ratio) == (256, None)
    both = parser.parse_args(["--kv-budget", "256", "--kv-compression-ratio", "0.5"])
    with pytest.raises(ValueError, match="budget and kv_compression.compression_ratio"):
        engine_config_from_args(both)
    lists = parser.parse_args(["--kv-layer-budgets", "0,0,64", "--kv-decode-eviction", "off"])
    assert lists.compression__layer_budgets == (0, 0, 64)
    assert lists.compression__decode_eviction is False


def test_missing_prompts_file_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "prompts.txt"
    assert cli.main(["generate", "--prompts-file", str(missing)]) == 2
    assert capsys.readouterr().err == f"error: --prompts-file: no such file: {missing}\n"
    missing.write_text("first\n\n  \nsecond\n", encoding="utf-8")
    args = argparse.Namespace(prompt=["zero"], prompts_file=str(missing))
    assert cli.read_prompts(args) == ["zero", "first", "second"]
    assert cli.read_prompts(argparse.Namespace(prompt=None, prompts_file=None)) == [
        cli.DEFAULT_PROMPT
    ]


def test_port_in_use_is_found_before_the_model_loads(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert cli.main(["serve", "--port", str(port), "--model", "/no/such/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: --port: 127.0.0.1:{port} is already in use; stop what listens there or "
        "choose another port\n"
    )
    with pytest.raises(ValueError, match=r"--port must be in 0\.\.65535, got 70000"):
        cli.check_port_free("127.0.0.1", 70000)


def test_llm_kv_compression_takes_a_dict_like_generate():
    from sparsekv.config import EngineConfig
    from sparsekv.llm import LLM, _apply_kwargs, _default_policy

    assert _default_policy(None) == CompressionConfig()
    assert _default_policy({"method": "none"}) == CompressionConfig(method="none")
    ratio = _default_policy({"compression_ratio": 0.75})
    assert (ratio.method, ratio.budget, ratio.compression_ratio) == ("snapkv", None, 0.75)
    given = CompressionConfig(method="h2o", budget=64)
    assert _default_policy(given) is given
    with pytest.raises(ValueError, match=r"^kv_compression\.budgett: unknown field"):
        LLM(kv_compression={"budgett": 64})  # raised before any model is loaded
    with pytest.raises(ValueError, match="kv_compression.method: unknown method 'snap'"):
        LLM(kv_compression={"method": "snap"})
    with pytest.raises(ValueError, match="kv_compression: expected None, a dict"):
        _default_policy("snapkv")
    config = EngineConfig()
    _apply_kwargs(config, {"max_num_seqs": 4, "block_size": 32})
    assert (config.scheduler.max_num_seqs, config.cache.block_size) == (4, 32)
    with pytest.raises(ValueError, match="^max_seqs: unknown engine setting; LLM takes model"):
        _apply_kwargs(config, {"max_seqs": 4})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (CompressionConfig(pooling="sum"), "kv_compression.pooling must be max, avg or none, got 'sum'"),
        (CompressionConfig(kernel_size=4), "kv_compression.kernel_size must be a positive odd number, got 4"),
        (CompressionConfig(budget=None, compression_ratio=1.0), r"kv_compression\.compression_ratio must be in \[0, 1\), got 1.0"),
        (CacheConfig(block_size=24), r"block_size must be a positive power of two \(16, 32, ...\), got 24"),
        (CacheConfig(kv_cache_dtype="int2"), "kv_cache_dtype must be one of auto, int8, fp8, int4, got 'int2'"),
    ],
)  # fmt: skip
def test_config_errors_name_the_parameter_and_the_allowed_values(config, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        config.validate()


def test_unknown_policy_field_lists_the_fields():
    with pytest.raises(
        ValueError, match=r"^kv_compression\.windw: unknown field; fields: budget, "
    ):
        CompressionConfig().merged({"windw": 8})


def test_generate_rejects_a_policy_of_the_wrong_type_before_queueing():
    from sparsekv.llm import LLM

    llm = LLM.__new__(LLM)  # no engine: the check runs before any prompt is encoded
    with pytest.raises(ValueError, match="^kv_compression: expected None, a dict .* got str$"):
        llm.generate("hi", kv_compression="snapkv")
    with pytest.raises(ValueError, match="^sampling_params: got 2 entries for 1 prompts$"):
        llm.generate("hi", [SamplingParams(), SamplingParams()])
