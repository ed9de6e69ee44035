"""``sparsekv convert``: write a GGUF checkpoint as a Hugging Face folder other engines load."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig

from sparsekv.loader.gguf import load_gguf
from sparsekv.models.families import FAMILIES

# transformers / vLLM pick the model class from config.architectures, which GGUF configs lack.
ARCHITECTURE_CLASSES = {
    model_type: family.hf_architecture
    for family in FAMILIES.values()
    for model_type in family.model_types
}

# Chat turns end with this token; generation should stop there as well as at config.eos.
END_OF_TURN_TOKENS = {"gemma3_text": "<end_of_turn>"}

# With ``overwrite``, files of an earlier checkpoint that loaders would read next to the new
# ones (every ``*.safetensors`` is loaded; a stale index or tokenizer file changes the model).
STALE_CHECKPOINT_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "*.bin.index.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
)

logger = logging.getLogger(__name__)


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Dequantize a GGUF file into an HF folder.

    Writes ``config.json`` (with ``architectures`` and ``dtype``), ``model.safetensors``
    (contiguous tensors in ``dtype``, HF names, no ``lm_head.weight`` when tied),
    ``generation_config.json`` (bos/eos/pad, plus the end-of-turn token for Gemma 3) and the
    tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``),
    each with the mode ``0o666`` less the umask (``0644`` under the usual ``022``).
    The folder loads with :func:`sparsekv.loader.load_checkpoint` and with
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)``.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: output folder: created, or an existing empty one.
        dtype: weight dtype; bf16 (default) halves the size, float32 keeps the dequantized
            values exactly.
        overwrite: also write into a folder that holds files (``--overwrite``): the files
            above are replaced and an earlier checkpoint's weights, index and tokenizer files
            (:data:`STALE_CHECKPOINT_FILES`) removed; other files stay.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ValueError: (message starts with ``model:``) the GGUF file is missing, malformed or
            unsupported; (``out_dir:``) the folder cannot be created or written, or it is not
            empty and ``overwrite`` is off.
    """
    out_dir = Path(out_dir)
    if not overwrite and out_dir.is_dir():
        held = sorted(entry.name for entry in out_dir.iterdir())
        if held:
            shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
            raise ValueError(
                f"out_dir: {out_dir} is not empty (it holds {shown}); pass --overwrite "
                "(overwrite=True) to replace its checkpoint files, or name a new folder"
            )
    try:  # before the (slow) load: a folder it cannot write fails at once
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"out_dir: cannot create {out_dir}: {exc.strerror or exc}") from exc
    if not os.access(out_dir, os.W_OK):
        raise ValueError(f"out_dir: {out_dir} is not writable")
    config, tokenizer, state_dict = load_gguf(gguf_path, dtype)
    config = copy.deepcopy(config)
    config.architectures = [ARCHITECTURE_CLASSES.get(config.model_type, "AutoModelForCausalLM")]
    config.dtype = dtype
    try:
        if overwrite:
            _remove_stale_files(out_dir)
        _save_safetensors(state_dict, out_dir / "model.safetensors")
        config.save_pretrained(out_dir)
        _generation_config(config, tokenizer).save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    except OSError as exc:
        raise ValueError(f"out_dir: cannot write into {out_dir}: {exc.strerror or exc}") from exc
    return out_dir


def _remove_stale_files(out_dir: Path) -> None:
    """Remove :data:`STALE_CHECKPOINT_FILES` but ``model.safetensors`` (replaced by a rename)."""
    found = {path for pattern in STALE_CHECKPOINT_FILES for path in out_dir.glob(pattern)}
    replaced = out_dir / "model.safetensors"
    stale = sorted(path for path in found if path != replaced)
    for path in stale:
        if path.is_file() or path.is_symlink():
            path.unlink()
    if stale:
        logger.info("convert: removed from %s: %s", out_dir, ", ".join(p.name for p in stale))


def _save_safetensors(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file`` into a temporary sibling, then renamed over ``path``: a failed write
    leaves no partial file. safetensors creates its files ``0600``; this one gets the mode the
    other files of the folder get (``0o666`` less the umask)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(state_dict, temporary, metadata={"format": "pt"})
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _umask() -> int:
    """The process umask, read without changing it where ``/proc`` tells it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _generation_config(config, tokenizer) -> GenerationConfig:
    generation = GenerationConfig.from_model_config(config)
    eos = generation.eos_token_id
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    end_of_turn = END_OF_TURN_TOKENS.get(config.model_type)
    if end_of_turn is not None:
        token_id = tokenizer.convert_tokens_to_ids(end_of_turn)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    generation.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return generation
