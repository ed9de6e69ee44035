"""Method name -> compressor class (the values of ``--kv-compression``)."""

from __future__ import annotations

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

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (
        SnapKVCompressor,
        PyramidKVCompressor,
        H2OCompressor,
        StreamingLLMCompressor,
        TOVACompressor,
        KNormCompressor,
        RandomCompressor,
        ExpectedAttentionCompressor,
        KVzipCompressor,
    )
}


def get_compressor(config: CompressionConfig) -> Compressor | None:
    """The compressor of a policy, or ``None`` when the policy is off.

    Off = method ``none`` or compression ratio 0 (``CompressionConfig.enabled``);
    ``layer_budgets`` gives every layer a full cache then too.

    Raises:
        ValueError: unknown method name.
    """
    if not config.enabled:
        return None
    if config.method not in COMPRESSORS:
        raise ValueError(
            f"kv_compression.method: unknown method {config.method!r}; "
            f"choose one of none, {', '.join(COMPRESSORS)}"
        )
    return COMPRESSORS[config.method].from_config(config)
