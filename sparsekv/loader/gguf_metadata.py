"""Config and tokenizer of a GGUF file, built by transformers and cached as an HF folder.

transformers parses the GGUF metadata with ``gguf.GGUFReader`` once for the config and once for
the tokenizer; on this project's CPUs that takes ~17 s for SmolLM2 and minutes for Gemma 3's
262k vocabulary. The result is saved (``save_pretrained``) under
``<cache>/gguf-meta/<stem>-<key>/``, keyed by the file's path, size and mtime and the
transformers version, and later loads read that folder in well under a second.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import transformers
from transformers import AutoConfig, AutoTokenizer

from sparsekv.loader.cache import cache_root, publish, temporary_sibling
from sparsekv.loader.chat_templates import DEFAULT_CHAT_TEMPLATES
from sparsekv.loader.gguf_file import GGUFFile

logger = logging.getLogger(__name__)

# Bump when what is stored in a cache entry changes.
CACHE_FORMAT = 1


def load_gguf_config_and_tokenizer(gguf: GGUFFile):
    """Hugging Face config and tokenizer for a GGUF file.

    The config is what ``AutoConfig.from_pretrained(folder, gguf_file=name)`` returns (for
    Gemma 3 a ``Gemma3TextConfig``, model_type ``gemma3_text``); the tokenizer is
    ``AutoTokenizer.from_pretrained(folder, gguf_file=name)``, given a default chat template when
    the file has none (:mod:`sparsekv.loader.chat_templates`).

    Args:
        gguf: the parsed file (validated already, so transformers sees a well-formed file).

    Returns:
        ``(config, tokenizer)``.
    """
    entry = metadata_cache_dir(gguf.path)
    if (entry / "config.json").is_file():
        return AutoConfig.from_pretrained(entry), AutoTokenizer.from_pretrained(entry)
    config, tokenizer = parse_with_transformers(gguf)
    _save_entry(entry, config, tokenizer)
    return config, tokenizer


def parse_with_transformers(gguf: GGUFFile):
    """Build config and tokenizer straight from the GGUF file with transformers (slow)."""
    folder, name = gguf.path.parent, gguf.path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if tokenizer.chat_template is None and gguf.architecture in DEFAULT_CHAT_TEMPLATES:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATES[gguf.architecture]
    return config, tokenizer


def metadata_cache_dir(path: Path) -> Path:
    """Cache folder for a GGUF file's config and tokenizer (may not exist yet)."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(f"{key}|{CACHE_FORMAT}".encode()).hexdigest()[:16]
    return cache_root() / "gguf-meta" / f"{path.stem}-{digest}"


def _save_entry(entry: Path, config, tokenizer) -> None:
    try:
        temporary = temporary_sibling(entry, directory=True)
    except OSError as exc:
        logger.warning("not caching GGUF metadata in %s: %s", entry, exc)
        return
    try:
        tokenizer.save_pretrained(temporary)
        config.save_pretrained(temporary)  # config.json last: its presence marks a full entry
    except OSError as exc:
        logger.warning("not caching GGUF metadata in %s: %s", entry, exc)
        shutil.rmtree(temporary, ignore_errors=True)
        return
    publish(temporary, entry)
