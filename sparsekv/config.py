"""Typed engine configuration, validated once.

Every user-facing setting lives in one of these dataclasses; the CLI flags are generated from
their fields (``sparsekv.cli_args``), the help line of each flag being the first sentence of
the field's entry under ``Attributes:``, so names, defaults and help never drift. Validation
raises ``ValueError`` naming the offending parameter and its allowed values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# COMPRESSION_METHODS here: the built-in names; register_compressor extends
# compression_config's, which CompressionConfig.validate reads.
from sparsekv.compression_config import (
    COMPRESSION_METHODS,
    HEAD_BUDGETS,
    LAYER_SCORES,
    CompressionConfig,
)
from sparsekv.kv_cache.quant import KV_CACHE_DTYPES
from sparsekv.parallel_config import ParallelConfig
from sparsekv.speculative_config import (
    MAX_SPECULATIVE_TOKENS,
    SPECULATIVE_METHOD_FIELDS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
)

DEVICES = ("auto", "cpu", "cuda")
# The names of ``attention.backends.BACKENDS`` (and ``auto``); a test keeps the two equal.
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
# The pool size on CPU when ``kv_cache_memory`` is not given, in GiB.
CPU_KV_CACHE_MEMORY = 2.0

# ``--weight-dtype`` values (``ModelConfig.weight_dtype``).
WEIGHT_DTYPES = ("auto", "bf16", "int8", "w8a8", "gguf")
# ``--prefill-qk-dtype`` values (``ModelConfig.prefill_qk_dtype``).
PREFILL_QK_DTYPES = ("auto", "int8")


@dataclass
class ModelConfig:
    """Which weights to serve and in which precision.

    Attributes:
        model: built-in name (``smollm2-135m-instruct``, ``gemma3-270m``), GGUF file or
            Hugging Face folder (config.json + safetensors).
        served_model_name: model id reported by /v1/models and accepted in requests.
        dtype: compute dtype: ``auto`` is bf16 where the CPU has AVX512-BF16 or AMX (or on
            CUDA), else fp32.
        device: torch device: ``auto`` (``cuda`` where a CUDA device is visible, else
            ``cpu``), ``cpu`` or ``cuda``.
        attention_backend: attention kernels: ``auto`` (the native C++ kernels on CPU where
            they build, else the PyTorch reference; Triton on CUDA where it imports),
            ``cpu`` (native C++), ``torch`` (reference) or ``triton``.
        enforce_eager: never capture CUDA graphs for decode steps (on CUDA the engine
            otherwise replays one graph per batch bucket for decode-only steps; CPU steps
            always run eagerly).
        max_model_len: context length in tokens (prompt + output).
        seed: seed for requests that give none (sampling stays reproducible per request).
        tokenizer: a tokenizer folder or file (``tokenizer.json``, a GGUF) to use instead of
            the model's own, e.g. for random-weight benchmark models.
        weight_dtype: how linear weights are stored: ``auto`` (the model dtype), ``bf16``
            (bf16 rows), ``int8`` (per output channel, quantized at load), ``w8a8`` (``int8``
            weights, and prefill-sized matmuls quantize activations per token to int8 where
            the CPU has the int8 path) or ``gguf`` (the GGUF file's Q4_0 / Q4_1 / Q5_0 / Q8_0
            blocks and Q4_K / Q6_K super-blocks kept packed). Packed weights run native kernels
            that dequantize in registers for up to 64 rows; embeddings and norms stay dense.
        prefill_qk_dtype: the logits (Q·K^T) of prefill attention: ``auto`` (the model
            dtype) or ``int8`` (keys smoothed by their channel means and quantized per key,
            queries per row, as SageAttention does; the value product stays bf16), which runs
            on the ``cpu`` backend's AVX512-BF16 prefill kernel with AVX512-VNNI (AMD Zen 4)
            for bf16 models with head_dim up to 256 (prompts and long chunks), and is ignored
            elsewhere (AMX, fp32, other backends, soft-capped models).
    """

    model: str = "smollm2-135m-instruct"
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    max_model_len: int | None = None
    seed: int = 0
    tokenizer: str | None = None
    weight_dtype: str = "auto"
    prefill_qk_dtype: str = "auto"

    def validate(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float32", "bf16", "fp32"):
            raise ValueError(f"dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}"
            )
        if self.prefill_qk_dtype not in PREFILL_QK_DTYPES:
            raise ValueError(
                f"prefill_qk_dtype must be one of {', '.join(PREFILL_QK_DTYPES)}, "
                f"got {self.prefill_qk_dtype!r}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0 tokens, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """Paged KV memory: pool size, page size, page format and prefix caching.

    Attributes:
        kv_cache_memory: GiB of KV memory, all of it pages; a request pays for its side
            state (stored window queries, H2O masses) with pages it holds. Unset, it is
            sized from the device: 2 GiB on CPU (refused above 80% of the available RAM); on
            CUDA the free memory after a profiling forward, up to ``gpu_memory_utilization``
            of the device.
        gpu_memory_utilization: fraction of the device's memory the engine may use for
            weights, activations and KV pages (CUDA; ignored on CPU and when
            ``kv_cache_memory`` is given).
        block_size: token slots per KV page (a power of two).
        kv_cache_dtype: page format: ``auto`` (the model dtype), ``int8``, ``fp8`` (e4m3) or
            ``int4`` (KIVI). ``int8``/``fp8`` keep one scale per page, K/V, head and slot;
            ``int4`` quantizes keys per channel and values per token and keeps the latest
            tokens at full precision (``kv_cache.quant``). The pool holds as many pages as fit
            their quantized size.
        kv_cache_full_precision_layers: layers kept in the model dtype when the page format is
            quantized, e.g. ``0,1``. They live in a second pool sized from the layer counts.
        enable_prefix_caching: share the KV pages of identical prompt prefixes between
            requests. Full pages are keyed by chained hashes of their token ids, ref-counted,
            and evicted least recently used only when the pool needs pages. Off for models
            with sliding-window layers.
        prefix_cache_uncompressed: also cache the uncompressed prompt of compressed requests
            while the pool has room. A later request with the same prefix then skips its
            compute and compresses its own copy.
        num_pages: pool size in pages, instead of deriving it from the memory size (tests
            and benchmarks that need an exact pool).
    """

    kv_cache_memory: float | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_full_precision_layers: tuple[int, ...] | None = None
    enable_prefix_caching: bool = True
    prefix_cache_uncompressed: bool = False
    num_pages: int | None = None

    def validate(self) -> None:
        memory = self.kv_cache_memory
        if memory is not None and not (0 < memory < math.inf):
            raise ValueError(f"kv_cache_memory must be a finite number > 0 GiB, got {memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"block_size must be a positive power of two (16, 32, ...), got {self.block_size}"
            )
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        layers = self.kv_cache_full_precision_layers or ()
        if any(not isinstance(x, int) or x < 0 for x in layers):
            raise ValueError(
                f"kv_cache_full_precision_layers must be layer indices >= 0, got {layers}"
            )
        if layers and self.kv_cache_dtype == "auto":
            raise ValueError(
                "kv_cache_full_precision_layers needs a quantized kv_cache_dtype (int8, fp8 or "
                "int4), got auto"
            )


@dataclass
class SchedulerConfig:
    """Continuous batching limits and preemption.

    Attributes:
        max_num_batched_tokens: the most tokens one engine step processes (decodes plus
            prefill chunks).
        max_num_seqs: the most requests running at once.
        preemption_mode: what happens to the newest request when pages run out: ``swap``
            (its pages go to host memory and come back bit-exactly) or ``recompute``
            (full-cache requests only).
        max_waiting: the most samples (``n`` per request) waiting for admission beyond the
            free running slots; the server answers 503 past it.
        watermark_pages: free pages kept in reserve when a waiting request is admitted.
    """

    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 64
    preemption_mode: str = "swap"
    max_waiting: int = 256
    watermark_pages: int = 8

    def validate(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.preemption_mode not in ("swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be swap or recompute, got {self.preemption_mode!r}"
            )
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.watermark_pages < 0:
            raise ValueError(f"watermark_pages must be >= 0, got {self.watermark_pages}")


@dataclass
class EngineConfig:
    """Everything the engine needs; ``validate()`` checks every part once."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.compression.validate()
        self.scheduler.validate()
        self.parallel.validate()
        self.speculative.validate()
        if self.speculative.enabled and self.cache.kv_cache_dtype == "int4":
            raise ValueError(
                "speculative_method: int4 pages keep their partial last page at full precision "
                "and cannot roll drafts back; use kv_cache_dtype auto, int8 or fp8"
            )
        check_head_budgets(self.compression, self)


def check_head_budgets(
    settings: CompressionConfig, config: EngineConfig, speculative: bool | None = None
) -> None:
    """Adaptive head budgets need what their head-wise pages support: full-precision pages,
    no speculative decoding (verification reads layers as equal-length heads) and one
    tensor-parallel rank. ``speculative``: whether the request speculates (``None``: the
    engine's setting).

    Raises:
        ValueError: naming ``kv_compression.head_budgets`` and the conflicting setting.
    """
    if settings.head_budgets != "adaptive" or not settings.enabled:
        return
    conflicts = {
        "kv_cache_dtype": config.cache.kv_cache_dtype != "auto",
        "speculative_method": config.speculative.enabled if speculative is None else speculative,
        "tensor_parallel_size": config.parallel.tensor_parallel_size > 1,
    }
    for name, conflict in conflicts.items():
        if conflict:
            raise ValueError(
                f"kv_compression.head_budgets: adaptive budgets do not run with {name} "
                f"(head-wise pages are full-precision, single-rank, without draft rollback)"
            )


__all__ = [
    "ATTENTION_BACKENDS",
    "COMPRESSION_METHODS",
    "CPU_KV_CACHE_MEMORY",
    "DEVICES",
    "HEAD_BUDGETS",
    "LAYER_SCORES",
    "MAX_SPECULATIVE_TOKENS",
    "PREFILL_QK_DTYPES",
    "SPECULATIVE_METHODS",
    "SPECULATIVE_METHOD_FIELDS",
    "WEIGHT_DTYPES",
    "CacheConfig",
    "CompressionConfig",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "check_head_budgets",
]
