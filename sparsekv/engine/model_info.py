"""What a front end needs to know about a served model, without holding its engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparsekv.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class ModelInfo:
    """The facts an API front end reads from an engine (picklable: Ray sends it to an ingress).

    Attributes:
        model_name: the served model id.
        tokenizer: the model's tokenizer (a Hugging Face tokenizer).
        max_model_len: context length in tokens.
        max_num_seqs: the most requests an engine runs at once.
        default_scope: the engine's default ``kv_compression.scope``.
        block_size: slots per page.
        prefix_caching: whether the prefix cache is on (it is off for sliding-window models).
        prefix_caching_requested: whether the configuration asked for it.
    """

    model_name: str
    tokenizer: Any
    max_model_len: int
    max_num_seqs: int
    default_scope: str
    block_size: int
    prefix_caching: bool
    prefix_caching_requested: bool

    @classmethod
    def of(cls, engine: LLMEngine) -> ModelInfo:
        """The facts of a loaded engine."""
        config = engine.config
        return cls(
            model_name=engine.model_name,
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            max_num_seqs=config.scheduler.max_num_seqs,
            default_scope=config.compression.scope,
            block_size=config.cache.block_size,
            prefix_caching=engine.kv.prefix_cache is not None,
            prefix_caching_requested=config.cache.enable_prefix_caching,
        )
