"""Typed engine configuration, validated once.

Every user-facing setting lives in one of these dataclasses; the CLI flags are generated from
their fields (``sparsekv.cli_args``), so names and defaults never drift from CONTRACTS.md §3.
Validation raises ``ValueError`` naming the offending parameter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sparsekv.kv_cache.quant import KV_CACHE_DTYPES

COMPRESSION_METHODS = (
    "none",
    "snapkv",
    "pyramidkv",
    "h2o",
    "streaming_llm",
    "tova",
    "knorm",
    "random",
)


@dataclass
class ModelConfig:
    """Which weights to serve and in which precision.

    Attributes:
        model: GGUF file path, Hugging Face folder, or built-in name
            (``smollm2-135m-instruct``, ``gemma3-270m``).
        served_model_name: id reported by /v1/models; defaults to the built-in name or file stem.
        dtype: ``auto`` (bf16 where the CPU has AVX512-BF16/AMX or on CUDA, else fp32),
            ``bfloat16`` or ``float32``.
        device: torch device string (``cpu`` or ``cuda``).
        max_model_len: context length in tokens; defaults to the model's own.
        seed: seed for requests that give none (sampling stays reproducible per request).
        tokenizer: a tokenizer folder or file (``tokenizer.json``, a GGUF) to use instead of
            the model's own, e.g. for random-weight benchmark models.
    """

    model: str = "smollm2-135m-instruct"
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    tokenizer: str | None = None

    def validate(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float32", "bf16", "fp32"):
            raise ValueError(f"dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be > 0")


@dataclass
class CacheConfig:
    """Paged KV memory (CONTRACTS.md §2).

    Attributes:
        kv_cache_memory: GiB for the page pool(s) and side state (stored window queries,
            H2O accumulators).
        block_size: slots per page.
        kv_cache_dtype: storage format of K/V pages: ``auto`` (the model dtype), ``int8``,
            ``fp8`` (float8_e4m3 codes, one scale per slot) or ``int4`` (KIVI: keys per
            channel, values per token, the latest tokens at full precision); see
            ``kv_cache.quant``. The pool holds as many pages as fit their quantized size.
        kv_cache_full_precision_layers: with a quantized format, layers whose pages stay in
            the model dtype (a second pool, sized from the layer counts), e.g. ``(0, 1)``.
        enable_prefix_caching: share full pages of identical prefixes between requests
            (chained hashes of token-id pages, ref-counted pages, LRU eviction of unreferenced
            cached pages only when the pool needs them). Off for models with sliding-window
            layers.
        prefix_cache_uncompressed: at a compressing prefill, also keep the budgeted layers'
            uncompressed prompt pages as evictable cached pages while the pool has room, so a
            later request with the same prefix skips its compute (then compresses its own copy).
        num_pages: pool size in pages, overriding the size derived from ``kv_cache_memory``
            (tests and benchmarks that need an exact pool).
    """

    kv_cache_memory: float = 2.0
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_full_precision_layers: tuple[int, ...] | None = None
    enable_prefix_caching: bool = True
    prefix_cache_uncompressed: bool = False
    num_pages: int | None = None

    def validate(self) -> None:
        if not self.kv_cache_memory > 0:
            raise ValueError("kv_cache_memory must be > 0 GiB")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        layers = self.kv_cache_full_precision_layers or ()
        if any(not isinstance(x, int) or x < 0 for x in layers):
            raise ValueError("kv_cache_full_precision_layers must be layer indices >= 0")
        if layers and self.kv_cache_dtype == "auto":
            raise ValueError("kv_cache_full_precision_layers needs a quantized kv_cache_dtype")


@dataclass
class CompressionConfig:
    """A KV compression policy (CONTRACTS.md §1 and §3), for the engine or one request.

    Attributes:
        method: compressor name, one of ``COMPRESSION_METHODS``; ``none`` disables compression.
        budget: slots each budgeted layer keeps, observation window included.
        compression_ratio: fraction of prompt tokens removed per budgeted layer, in [0, 1);
            exclusive with ``budget``. ``0`` turns the policy off for the request.
        window: observation window (the last ``window`` prompt tokens' queries score the rest).
        pooling: score smoothing over tokens, ``max`` or ``avg``.
        kernel_size: pooling kernel (odd), stride 1, padding ``kernel_size // 2``.
        gqa_agg: aggregation of a KV group's query-head scores, ``mean`` or ``max``.
        full_layers: the first N layers keep a full cache.
        layer_budgets: explicit budget per layer (0 = full); overrides budget/ratio/full_layers.
        decode_eviction: re-score and compact a layer at ``budget + block_size`` slots.
        chunked_mode: ``exact`` (score after the last chunk) or ``bounded`` (after every chunk).
        scope: ``prompt`` or ``context`` (compress the shared context only).
        context_tokens: for scope ``context`` on a completion prompt, the context length.
    """

    method: str = "snapkv"
    budget: int | None = 1024
    compression_ratio: float | None = None
    window: int = 32
    pooling: str = "max"
    kernel_size: int = 7
    gqa_agg: str = "mean"
    full_layers: int = 2
    layer_budgets: tuple[int, ...] | None = None
    decode_eviction: bool = True
    chunked_mode: str = "exact"
    scope: str = "prompt"
    context_tokens: int | None = None

    @property
    def enabled(self) -> bool:
        """False when the policy removes nothing (method none or ratio 0)."""
        return self.method != "none" and self.compression_ratio != 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the parameter when the policy is invalid."""
        if self.method not in COMPRESSION_METHODS:
            raise ValueError(
                f"kv_compression.method: unknown method {self.method!r}; "
                f"choose one of {', '.join(COMPRESSION_METHODS)}"
            )
        if self.budget is not None and self.compression_ratio is not None:
            raise ValueError(
                "kv_compression.budget and kv_compression.compression_ratio are exclusive"
            )
        if self.window < 1:
            raise ValueError("kv_compression.window must be >= 1")
        if self.budget is not None and self.budget < self.window + 1:
            raise ValueError(
                f"kv_compression.budget ({self.budget}) must be >= window + 1 ({self.window + 1})"
            )
        if self.compression_ratio is not None and not 0 <= self.compression_ratio < 1:
            raise ValueError("kv_compression.compression_ratio must be in [0, 1)")
        if self.pooling not in ("max", "avg", "none"):
            raise ValueError("kv_compression.pooling must be max, avg or none")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError("kv_compression.kernel_size must be a positive odd number")
        if self.gqa_agg not in ("mean", "max"):
            raise ValueError("kv_compression.gqa_agg must be mean or max")
        if self.full_layers < 0:
            raise ValueError("kv_compression.full_layers must be >= 0")
        if self.layer_budgets is not None:
            for b in self.layer_budgets:
                if b != 0 and b < self.window + 1:
                    raise ValueError(
                        f"kv_compression.layer_budgets: {b} is below window + 1 ({self.window + 1})"
                    )
        if self.chunked_mode not in ("exact", "bounded"):
            raise ValueError("kv_compression.chunked_mode must be exact or bounded")
        if self.scope not in ("prompt", "context"):
            raise ValueError("kv_compression.scope must be prompt or context")
        if self.context_tokens is not None and self.context_tokens < 1:
            raise ValueError("kv_compression.context_tokens must be >= 1")

    def merged(self, overrides: dict) -> CompressionConfig:
        """Return a copy with ``overrides`` applied field by field (CONTRACTS.md §3).

        Budget and ratio are one choice: giving either replaces the other.

        Raises:
            ValueError: an unknown field name, or the merged policy is invalid.
        """
        names = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in names:
                raise ValueError(f"kv_compression.{key}: unknown field")
        values = dict(overrides)
        if "budget" in values and "compression_ratio" not in values:
            values["compression_ratio"] = None
        if "compression_ratio" in values and "budget" not in values:
            values["budget"] = None
        if "layer_budgets" in values and values["layer_budgets"] is not None:
            values["layer_budgets"] = tuple(values["layer_budgets"])
        merged = dataclasses.replace(self, **values)
        merged.validate()
        return merged


@dataclass
class SchedulerConfig:
    """Continuous batching limits (CONTRACTS.md §2-§3).

    Attributes:
        max_num_batched_tokens: step token budget, the most tokens one engine step processes.
        max_num_seqs: running requests at most.
        preemption_mode: ``swap`` (default; bit-exact for compressed requests) or ``recompute``.
        max_waiting: waiting-queue length at most (the server answers 503 past it).
        watermark_pages: free pages kept in reserve when admitting a waiting request.
    """

    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 64
    preemption_mode: str = "swap"
    max_waiting: int = 256
    watermark_pages: int = 8

    def validate(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError("preemption_mode must be swap or recompute")
        if self.max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")


@dataclass
class EngineConfig:
    """Everything the engine needs; ``validate()`` checks every part once."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.compression.validate()
        self.scheduler.validate()
