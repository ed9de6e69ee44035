"""Typed engine configuration, validated once.

Every user-facing setting lives in one of these dataclasses; the CLI flags are generated from
their fields (``sparsekv.cli_args``), the help line of each flag being the first sentence of
the field's entry under ``Attributes:``, so names, defaults and help never drift. Validation
raises ``ValueError`` naming the offending parameter and its allowed values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from sparsekv.kv_cache.quant import KV_CACHE_DTYPES
from sparsekv.parallel_config import ParallelConfig

DEVICES = ("auto", "cpu", "cuda")
# The names of ``attention.backends.BACKENDS`` (and ``auto``); a test keeps the two equal.
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
# The pool size on CPU when ``kv_cache_memory`` is not given, in GiB.
CPU_KV_CACHE_MEMORY = 2.0

# ``--weight-dtype`` values (``ModelConfig.weight_dtype``).
WEIGHT_DTYPES = ("auto", "bf16", "int8", "w8a8", "gguf")
# ``--prefill-qk-dtype`` values (``ModelConfig.prefill_qk_dtype``).
PREFILL_QK_DTYPES = ("auto", "int8")

COMPRESSION_METHODS = (
    "none",
    "snapkv",
    "pyramidkv",
    "h2o",
    "streaming_llm",
    "tova",
    "knorm",
    "random",
    "expected_attention",
    "kvzip",
)
HEAD_BUDGETS = ("flat", "adaptive")
LAYER_SCORES = ("own", "first")


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
            the CPU has int8 dot products) or ``gguf`` (the GGUF file's Q4_0 / Q4_1 / Q8_0
            blocks kept packed). Packed weights run native kernels that dequantize in
            registers for up to 64 rows; embeddings and norms stay dense.
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
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
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
class CompressionConfig:
    """A KV compression policy, for the engine (its default) or one request.

    Budgets: a budgeted layer keeps ``budget`` slots, the observation window included; with
    ``compression_ratio`` r instead, each budgeted layer keeps
    ``max(window + 1, ceil((1 - r) * n_prompt))`` slots. The first ``full_layers`` layers and
    sliding-window layers are never compressed. ``pyramidkv`` reads the budget as the average
    over budgeted layers. ``docs/compression.md`` describes every method.

    Attributes:
        method: compression method; ``none`` keeps the full cache.
        budget: KV slots each budgeted layer keeps, observation window included; prompts
            this short or shorter are not compressed.
        compression_ratio: fraction of the prompt's tokens removed in each budgeted layer, in
            [0, 1), instead of a budget. ``0`` turns the policy off for the request.
        window: observation window: the last N prompt tokens, whose queries score the rest.
        pooling: smoothing of the scores over neighbouring tokens (``none`` = off).
        kernel_size: pooling kernel width (odd; stride 1, same padding).
        gqa_agg: how the scores of a KV group's query heads are combined.
        full_layers: the first N layers keep a full cache.
        layer_budgets: explicit budget per layer (0 = full cache), e.g. ``0,0,512,...``;
            overrides budget, ratio and full_layers.
        layer_fractions: fraction of the compressed tokens each layer keeps, in (0, 1] (1 =
            full cache), e.g. from ``sparsekv calibrate``; overrides budget, ratio and
            full_layers.
        decode_eviction: during decode, re-score a layer and compact it back to its budget
            when it holds ``budget + block_size`` slots.
        chunked_mode: when a chunked prefill is scored: ``exact`` (once, after the last
            chunk) or ``bounded`` (after every chunk: less memory, approximate).
        scope: what is compressed: the whole ``prompt``, or only the ``context`` before the
            last user message (compressed once, then shared by later requests).
        context_tokens: for scope ``context`` on a completion prompt, the context length
            (another scope rejects it).
        head_budgets: how a layer's budget is split among its KV heads: ``flat`` (every head
            keeps ``budget`` slots) or ``adaptive`` (the heads share ``num_kv_heads * budget``
            slots by score, Ada-KV; set once at prefill, no decode-time eviction).
        layer_scores: whose scores rank a budgeted layer's slots when a prompt is compressed:
            its ``own``, or those of the ``first`` budgeted layer that compresses in the same
            forward (as GemFilter selects tokens with an early layer's attention; a layer
            holding another number of slots scores its own; docs/compression.md).
    """

    method: str = "snapkv"
    budget: int | None = 1024
    compression_ratio: float | None = None
    window: int = 32
    pooling: str = "max"
    kernel_size: int = 15
    gqa_agg: str = "mean"
    full_layers: int = 2
    layer_budgets: tuple[int, ...] | None = None
    layer_fractions: tuple[float, ...] | None = None
    decode_eviction: bool = True
    chunked_mode: str = "exact"
    scope: str = "prompt"
    context_tokens: int | None = None
    head_budgets: str = "flat"
    layer_scores: str = "own"

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
            raise ValueError(f"kv_compression.window must be >= 1, got {self.window}")
        if self.budget is not None and self.budget < self.window + 1:
            raise ValueError(
                f"kv_compression.budget ({self.budget}) must be >= window + 1 ({self.window + 1})"
            )
        if self.compression_ratio is not None and not 0 <= self.compression_ratio < 1:
            raise ValueError(
                f"kv_compression.compression_ratio must be in [0, 1), got {self.compression_ratio}"
            )
        if self.pooling not in ("max", "avg", "none"):
            raise ValueError(
                f"kv_compression.pooling must be max, avg or none, got {self.pooling!r}"
            )
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(
                f"kv_compression.kernel_size must be a positive odd number, got {self.kernel_size}"
            )
        if self.gqa_agg not in ("mean", "max"):
            raise ValueError(f"kv_compression.gqa_agg must be mean or max, got {self.gqa_agg!r}")
        if self.full_layers < 0:
            raise ValueError(f"kv_compression.full_layers must be >= 0, got {self.full_layers}")
        if self.layer_budgets is not None:
            for b in self.layer_budgets:
                if b != 0 and b < self.window + 1:
                    raise ValueError(
                        f"kv_compression.layer_budgets: {b} is below window + 1 ({self.window + 1})"
                    )
        if self.layer_fractions is not None:
            if self.layer_budgets is not None:
                raise ValueError(
                    "kv_compression.layer_fractions and kv_compression.layer_budgets are exclusive"
                )
            for f in self.layer_fractions:
                if not 0 < f <= 1:
                    raise ValueError(f"kv_compression.layer_fractions: {f} is not in (0, 1]")
        if self.chunked_mode not in ("exact", "bounded"):
            raise ValueError(
                f"kv_compression.chunked_mode must be exact or bounded, got {self.chunked_mode!r}"
            )
        if self.scope not in ("prompt", "context"):
            raise ValueError(f"kv_compression.scope must be prompt or context, got {self.scope!r}")
        if self.context_tokens is not None and self.context_tokens < 1:
            raise ValueError(
                f"kv_compression.context_tokens must be >= 1, got {self.context_tokens}"
            )
        if self.context_tokens is not None and self.scope != "context":
            # Only scope "context" reads it: under another scope it would be silently ignored.
            raise ValueError(
                f"kv_compression.context_tokens applies only to scope 'context'; the scope is "
                f"{self.scope!r}"
            )
        if self.head_budgets not in HEAD_BUDGETS:
            raise ValueError(
                f"kv_compression.head_budgets must be flat or adaptive, got {self.head_budgets!r}"
            )
        if self.layer_scores not in LAYER_SCORES:
            raise ValueError(
                f"kv_compression.layer_scores must be own or first, got {self.layer_scores!r}"
            )
        if self.head_budgets == "adaptive" and self.chunked_mode == "bounded":
            raise ValueError(
                "kv_compression.head_budgets: adaptive budgets are set once at the end of the "
                "prompt; chunked_mode bounded compresses every chunk"
            )

    def merged(self, overrides: dict) -> CompressionConfig:
        """Return a copy with ``overrides`` applied field by field.

        Budget and ratio are one choice: giving either replaces the other.

        Raises:
            ValueError: an unknown field name, or the merged policy is invalid.
        """
        names = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in names:
                raise ValueError(
                    f"kv_compression.{key}: unknown field; fields: {', '.join(sorted(names))}"
                )
        values = dict(overrides)
        if "budget" in values and "compression_ratio" not in values:
            values["compression_ratio"] = None
        if "compression_ratio" in values and "budget" not in values:
            values["budget"] = None
        if "layer_budgets" in values and values["layer_budgets"] is not None:
            values["layer_budgets"] = tuple(values["layer_budgets"])
        if "layer_fractions" in values and values["layer_fractions"] is not None:
            values["layer_fractions"] = tuple(values["layer_fractions"])
        merged = dataclasses.replace(self, **values)
        merged.validate()
        return merged


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
        max_waiting: the most requests waiting for admission; the server answers 503 past it.
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


SPECULATIVE_METHODS = ("ngram", "sparse_self")
# Draft tokens per step at most: a verification is K + 1 query rows per request and layer.
MAX_SPECULATIVE_TOKENS = 32
# The fields only one drafter reads, and that drafter's method.
SPECULATIVE_METHOD_FIELDS = {
    "ngram_prompt_lookup_min": "ngram",
    "ngram_prompt_lookup_max": "ngram",
    "draft_sink_tokens": "sparse_self",
    "draft_recent_tokens": "sparse_self",
    "draft_vocab_size": "sparse_self",
}


@dataclass
class SpeculativeConfig:
    """Speculative decoding: cheap draft tokens verified by one step of the target model.

    A request with drafts scores its last token and ``k`` drafts as one short chunk against its
    own KV cache, keeps the longest accepted prefix plus one token of the target's, and rolls the
    rest back (docs/speculative.md). Greedy output is unchanged; sampled output keeps the
    target's distribution (rejection sampling).

    The ``ngram_*`` fields are read only by the ``ngram`` drafter and the ``draft_*`` fields only
    by ``sparse_self``. In the engine's settings the other method's fields are kept unchecked:
    they are the defaults a request inherits when it switches method (and a dataclass cannot
    tell a default from a value that was set). A request that itself gives a field its own
    method never reads gets a ``ValueError`` naming it (``check_request_fields``) instead of
    having it ignored.

    Attributes:
        method: how drafts are proposed: ``ngram`` (prompt lookup: the tokens that followed the
            latest earlier occurrence of the sequence's last n tokens) or ``sparse_self`` (the
            model itself drafts, reading only the sink and most recent pages of its own
            cache); unset is off.
        num_speculative_tokens: draft tokens proposed per request and step (K), at most
            32 (``MAX_SPECULATIVE_TOKENS``).
        ngram_prompt_lookup_min: shortest suffix n-gram the ``ngram`` drafter matches.
        ngram_prompt_lookup_max: longest suffix n-gram the ``ngram`` drafter matches (tried
            first).
        draft_sink_tokens: ``sparse_self``: leading slots of each layer the draft reads
            (rounded up to whole pages).
        draft_recent_tokens: ``sparse_self``: most recent slots of each layer the draft
            reads (extended back to a page start); sliding-window layers read their window.
        draft_vocab_size: ``sparse_self``: the draft proposes only token ids below this
            (rounded up to a multiple of 16) and reads only those rows of the output head;
            0, or at least the vocabulary, proposes from all of it.
            Verification always scores the whole vocabulary.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    ngram_prompt_lookup_min: int = 1
    ngram_prompt_lookup_max: int = 4
    draft_sink_tokens: int = 64
    draft_recent_tokens: int = 448
    draft_vocab_size: int = 0

    @property
    def enabled(self) -> bool:
        return self.method is not None and self.num_speculative_tokens > 0

    def validate(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        names = ("num_speculative_tokens", "ngram_prompt_lookup_min")
        for name in (*names, "draft_sink_tokens", "draft_recent_tokens", "draft_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.ngram_prompt_lookup_min < 1:
            raise ValueError(
                f"ngram_prompt_lookup_min must be >= 1, got {self.ngram_prompt_lookup_min}"
            )
        high = self.ngram_prompt_lookup_max
        if (
            not isinstance(high, int)
            or isinstance(high, bool)
            or high < self.ngram_prompt_lookup_min
        ):
            raise ValueError(
                f"ngram_prompt_lookup_max must be an integer >= ngram_prompt_lookup_min "
                f"({self.ngram_prompt_lookup_min}), got {high!r}"
            )

    def check_request_fields(self, given: Iterable[str]) -> None:
        """Reject fields a request gave that its method (these merged settings') never reads.

        Args:
            given: the names of the fields the request set.

        Raises:
            ValueError: naming ``speculative.<field>``, e.g. ``draft_recent_tokens`` with the
                ``ngram`` method or with speculation off.
        """
        for name in given:
            owner = SPECULATIVE_METHOD_FIELDS.get(name)
            if owner is not None and self.method != owner:
                raise ValueError(
                    f"speculative.{name} applies only to method {owner!r}; the request's "
                    f"method is {self.method!r}"
                )
            if owner is not None and not self.enabled:  # the method, but no drafts
                raise ValueError(
                    f"speculative.{name} applies only with speculation on; the request's "
                    f"num_speculative_tokens is 0"
                )

    def merged(self, overrides: dict) -> SpeculativeConfig:
        """A copy with a request's ``speculative`` fields applied (``method: null`` or
        ``num_speculative_tokens: 0`` opts the request out).

        Raises:
            ValueError: an unknown field or an invalid merged setting.
        """
        names = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in names:
                raise ValueError(
                    f"speculative.{key}: unknown field; fields: {', '.join(sorted(names))}"
                )
        merged = dataclasses.replace(self, **overrides)
        try:
            merged.validate()
        except ValueError as exc:
            message = str(exc).removeprefix("speculative_")
            raise ValueError(f"speculative.{message}") from None
        return merged


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
