"""A Hugging Face folder's config.json and layers are checked at load, and ``convert`` refuses a
folder that holds files and writes every file with the umask's mode.

The folder is the tiny Llama 3 fixture (``fixtures/gguf/llama3``: 2 layers, width 32, 4 heads
over 2 KV heads), copied and its config edited; ``convert`` runs on its GGUF file.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from sparsekv.cli import main
from sparsekv.loader import convert_gguf, load_checkpoint

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
# What convert writes for the fixture (its tokenizer has no chat template to write).
CONVERTED = {
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def _folder(tmp_path: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(FIXTURES / "llama3", folder)
    config = json.loads((folder / "config.json").read_text())
    for key in drop:
        config.pop(key)
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _refused(folder: Path) -> str:
    with pytest.raises(ValueError) as caught:
        load_checkpoint(str(folder), torch.float32)
    assert type(caught.value) is ValueError  # not a TypeError or huggingface_hub's errors
    message = str(caught.value)
    assert message.startswith(f"model: {folder / 'config.json'}"), message
    return message


def test_fixture_folder_loads(tmp_path):
    checkpoint = load_checkpoint(str(_folder(tmp_path)), torch.float32)
    assert checkpoint.hf_config.num_hidden_layers == 2


@pytest.mark.parametrize(
    "drop,changes,expected",
    [
        # Was a TypeError from transformers' YaRN initialiser, at model build.
        (
            ("rope_parameters",),
            {"rope_scaling": {"type": "yarn", "factor": "x"}},
            'rope_scaling.factor is "x"; expected a number > 0',
        ),
        (
            ("rope_parameters",),
            {"rope_scaling": {"type": "yarn"}},
            'rope_scaling is {"type": "yarn"}; expected an object with factor',
        ),
        (
            (),
            {"rope_parameters": {"rope_type": "spiral", "rope_theta": 1e4}},
            'rope_parameters.rope_type is "spiral"',
        ),
        # Were huggingface_hub's StrictDataclassClassValidationError.
        ((), {"num_attention_heads": 7}, "num_attention_heads 7 is not a multiple of"),
        ((), {"hidden_size": 30}, "hidden_size 30 is not a multiple of num_attention_heads 4"),
        # Was huggingface_hub's StrictDataclassFieldValidationError.
        ((), {"rms_norm_eps": None}, "rms_norm_eps is null; expected a number > 0"),
        ((), {"hidden_size": "32"}, 'hidden_size is "32"; expected an integer >= 1'),
        ((), {"num_attention_heads": 0}, "num_attention_heads is 0; expected an integer >= 1"),
        ((), {"tie_word_embeddings": "no"}, 'tie_word_embeddings is "no"'),
        # Were accepted: a context of 0 tokens, or a negative one.
        ((), {"max_position_embeddings": 0}, "max_position_embeddings is 0; expected an integer"),
        ((), {"max_position_embeddings": -8}, "max_position_embeddings is -8; expected"),
    ],
)
def test_bad_config_values_name_the_field_and_value(tmp_path, drop, changes, expected):
    message = _refused(_folder(tmp_path, drop, **changes))
    assert expected in message, message


def test_config_transformers_refuses_is_a_model_error(tmp_path):
    message = _refused(_folder(tmp_path, model_type="not-a-model"))
    assert "is refused by transformers" in message and "not-a-model" in message


def test_unreadable_config_is_a_model_error(tmp_path):
    folder = _folder(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"^model: cannot read .*config\.json") as caught:
        load_checkpoint(str(folder), torch.float32)
    assert type(caught.value) is ValueError


@pytest.mark.parametrize(
    "layers,expected",
    [
        # Was accepted: the decoder ran 1 layer and ignored layer 1's tensors.
        (
            1,
            "sets num_hidden_layers 1, but the checkpoint holds weights of 2 layers (also layer 1)",
        ),
        (4, "sets num_hidden_layers 4, but the checkpoint holds no weights for layers 2-3"),
    ],
)
def test_layers_must_be_the_configs(tmp_path, layers, expected):
    message = _refused(_folder(tmp_path, num_hidden_layers=layers))
    assert expected in message, message


def test_cli_prints_the_model_error(tmp_path, capsys):
    folder = _folder(tmp_path, rms_norm_eps=None)
    argv = ["generate", "--model", str(folder), "--prompt", "hi", "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model: ") and "rms_norm_eps is null" in err, err


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(folder: Path) -> dict[str, int]:
    return {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}


def test_convert_writes_every_file_with_the_umasks_mode(tmp_path, umask_022):
    out = convert_gguf(FIXTURES / "llama3.gguf", tmp_path / "out")
    modes = _modes(out)
    assert set(modes) == CONVERTED  # no temporary file left behind
    assert modes == dict.fromkeys(CONVERTED, 0o644)  # safetensors alone was 0600
    os.umask(0o027)
    out = convert_gguf(FIXTURES / "llama3.gguf", tmp_path / "out027")
    assert _modes(out)["model.safetensors"] == 0o640


def test_convert_refuses_a_folder_that_holds_files(tmp_path, umask_022):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError) as caught:
        convert_gguf(FIXTURES / "llama3.gguf", out)
    assert type(caught.value) is ValueError
    message = str(caught.value)
    assert message.startswith(f"out_dir: {out} is not empty"), message
    assert "notes.txt" in message and "--overwrite" in message
    assert _modes(out) == {"notes.txt": 0o644}  # nothing written
    convert_gguf(FIXTURES / "llama3.gguf", tmp_path / "new")  # a new folder is fine
    (tmp_path / "fresh").mkdir()  # and so is an empty one
    convert_gguf(FIXTURES / "llama3.gguf", tmp_path / "fresh")


def test_convert_overwrite_replaces_the_checkpoint_and_keeps_other_files(tmp_path, umask_022):
    out = tmp_path / "out"
    convert_gguf(FIXTURES / "llama3.gguf", out)
    stale = ["model-00002-of-00002.safetensors", "model.safetensors.index.json", "vocab.json"]
    for name in [*stale, "README.md"]:
        (out / name).write_text("{}")
    os.chmod(out / "model.safetensors", 0o600)
    assert main(["convert", str(FIXTURES / "llama3.gguf"), str(out)]) == 2  # refused
    assert main(["convert", "--overwrite", str(FIXTURES / "llama3.gguf"), str(out)]) == 0
    assert set(_modes(out)) == CONVERTED | {"README.md"}
    assert _modes(out)["model.safetensors"] == 0o644
    checkpoint = load_checkpoint(str(out), torch.float32)
    assert checkpoint.hf_config.num_hidden_layers == 2


def test_multimodal_and_per_layer_type_fields_are_named_by_their_path():
    from sparsekv.loader.hf_config import check_config_values

    nested = {"full_attention": {"rope_type": "linear", "factor": 0}, "sliding_attention": None}
    raw = {"model_type": "gemma3", "text_config": {"hidden_size": 640, "rope_parameters": nested}}
    with pytest.raises(ValueError) as caught:
        check_config_values(raw, "m/config.json")
    assert type(caught.value) is ValueError
    assert str(caught.value) == (
        "model: m/config.json: text_config.rope_parameters.full_attention.factor is 0; "
        "expected a number > 0"
    )
    nested["full_attention"]["factor"] = 8.0
    check_config_values(raw, "m/config.json")  # valid now
