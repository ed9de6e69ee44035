"""Method name -> compressor class (the values of ``--kv-compression``).

A method is one ``Compressor`` subclass (its scoring, its capabilities as class attributes, its
budget schedule) and one entry here; nothing else in the engine names a method.
"""

from __future__ import annotations

import sparsekv.compression_config as config_module
from sparsekv.compression.base import Compressor
from sparsekv.compression.expected_attention import ExpectedAttentionCompressor
from sparsekv.compression.h2o import H2OCompressor
from sparsekv.compression.knorm import KNormCompressor
from sparsekv.compression.kvzip import KVzipCompressor
from sparsekv.compression.pyramidkv import PyramidKVCompressor
from sparsekv.compression.random_method import RandomCompressor
from sparsekv.compression.snapkv import SnapKVCompressor
from sparsekv.compression.streaming_llm import StreamingLLMCompressor
from sparsekv.compression.tova import TOVACompressor
from sparsekv.config import CompressionConfig

COMPRESSORS: dict[str, type[Compressor]] = {}


def register_compressor(cls: type[Compressor]) -> type[Compressor]:
    """Add a method: ``cls.name`` becomes a valid ``kv_compression.method`` (usable as a class
    decorator; the class is returned unchanged).

    Raises:
        ValueError: the name is empty, ``none``, or taken by another class.
    """
    name = cls.name
    if not name or name == "none" or COMPRESSORS.get(name, cls) is not cls:
        raise ValueError(f"kv_compression.method: cannot register {name!r} for {cls.__name__}")
    COMPRESSORS[name] = cls
    if name not in config_module.COMPRESSION_METHODS:
        # ``CompressionConfig.validate`` reads the module's names at call time.
        config_module.COMPRESSION_METHODS = (*config_module.COMPRESSION_METHODS, name)
    return cls


for _cls in (
    SnapKVCompressor,
    PyramidKVCompressor,
    H2OCompressor,
    StreamingLLMCompressor,
    TOVACompressor,
    KNormCompressor,
    RandomCompressor,
    ExpectedAttentionCompressor,
    KVzipCompressor,
):
    register_compressor(_cls)


def compressor_class(method: str) -> type[Compressor]:
    """The class of a method name (capabilities and budget schedule without an instance).

    Raises:
        ValueError: unknown method name (naming ``kv_compression.method``).
    """
    if method not in COMPRESSORS:
        raise ValueError(
            f"kv_compression.method: unknown method {method!r}; "
            f"choose one of none, {', '.join(COMPRESSORS)}"
        )
    return COMPRESSORS[method]


def get_compressor(config: CompressionConfig) -> Compressor | None:
    """The compressor of a policy, or ``None`` when the policy is off.

    Off = method ``none`` or compression ratio 0 (``CompressionConfig.enabled``);
    ``layer_budgets`` gives every layer a full cache then too.

    Raises:
        ValueError: unknown method name.
    """
    if not config.enabled:
        return None
    return compressor_class(config.method).from_config(config)
