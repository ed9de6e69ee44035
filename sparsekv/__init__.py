"""sparsekv: an LLM serving engine whose paged KV cache is sparse layer by layer."""

from sparsekv.config import (
    CacheConfig,
    CompressionConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from sparsekv.outputs import CompletionOutput, KVStats, RequestOutput
from sparsekv.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "CompressionConfig",
    "EngineConfig",
    "KVStats",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from sparsekv.llm import LLM

        return LLM
    raise AttributeError(name)
