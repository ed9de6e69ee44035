"""Build the engine's parts from a config: weights, model, page pool, scheduler, runner.

The device and dtype are resolved here (``auto``: CUDA where visible; bf16 on CUDA or on CPUs
that compute it natively); the pool's page count comes from ``engine.pool_sizing``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsekv.attention.backends import AttentionBackend, create_backend
from sparsekv.config import EngineConfig, SpeculativeConfig
from sparsekv.engine.device_memory import kv_cache_gib, profile_forward
from sparsekv.engine.model_len import LONG_MAX_MODEL_LEN, model_len_of
from sparsekv.engine.pool_sizing import (
    GIB,
    available_memory_bytes,
    full_precision_layers,
    num_pool_pages,
)
from sparsekv.engine.scheduler import Scheduler
from sparsekv.host_allocator import tune_host_allocator
from sparsekv.kv_cache.manager import KVCacheManager
from sparsekv.models.prepack import can_prepack, prepack_linears
from sparsekv.models.quant.apply import apply_weight_dtype
from sparsekv.models.registry import build_model
from sparsekv.runner.model_runner import ModelRunner

__all__ = [
    "GIB",
    "LONG_MAX_MODEL_LEN",
    "EngineParts",
    "available_memory_bytes",
    "build_engine_parts",
    "cpu_flags",
    "eos_ids_of",
    "full_precision_layers",
    "has_native_bf16",
    "make_kv_manager",
    "model_len_of",
    "num_pool_pages",
    "resolve_device",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything ``LLMEngine`` runs on."""

    model_name: str
    tokenizer: object
    hf_config: object
    model: torch.nn.Module
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    dtype: torch.dtype


def resolve_device(name: str) -> str:
    """``--device``: ``auto`` is ``cuda`` where a CUDA device is visible, else ``cpu``.

    Raises:
        ValueError: ``cuda`` asked for where no CUDA device is visible.
    """
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} but no CUDA device is visible")
    return name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto`` -> bf16 on CUDA or on CPUs with AVX512-BF16/AMX, else fp32."""
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    table.update({"float32": torch.float32, "fp32": torch.float32})
    if name in table:
        return table[name]
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if has_native_bf16() else torch.float32


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX): where ``auto`` means bf16
    and bf16 weights are worth pre-packing (elsewhere, fp32 ones)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def make_kv_manager(
    config: EngineConfig,
    model: torch.nn.Module,
    backend,
    device: str,
    dtype: torch.dtype,
    num_pages: int | tuple[int, int],
    max_model_len: int | None = None,
) -> KVCacheManager:
    """The KV manager of ``model`` (its ``num_kv_heads`` per page) with ``num_pages`` pages.

    Prefix caching is turned off for models with sliding-window layers unless a step's token
    budget (``max_num_batched_tokens``) covers ``max_model_len``: then a prompt that runs in
    one step offers its pages before any sliding layer frees one (a chunked prompt offers
    nothing, as the prefix cache checks), and the cache's references keep them for later hits.
    """
    specs = model.layer_specs()
    prefix_caching = config.cache.enable_prefix_caching
    one_step = max_model_len is not None
    one_step = one_step and config.scheduler.max_num_batched_tokens >= max_model_len
    if prefix_caching and any(spec.is_sliding for spec in specs) and not one_step:
        # A hit would need the pages sliding-window layers already freed.
        logger.info("prefix caching is off: the model has sliding-window layers")
        prefix_caching = False
    return KVCacheManager(
        specs,
        num_pages,
        config.cache.block_size,
        model.num_kv_heads,
        model.head_dim,
        dtype,
        device,
        config.scheduler.max_num_batched_tokens,
        enable_prefix_caching=prefix_caching,
        prefix_cache_uncompressed=config.cache.prefix_cache_uncompressed,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        full_precision_layers=full_precision_layers(config, len(specs)),
        backend=backend,
        num_heads=model.num_heads,
    )


def build_engine_parts(config: EngineConfig, checkpoint=None) -> EngineParts:
    """Load weights and build the model, pool, scheduler and runner.

    Args:
        config: engine configuration.
        checkpoint: a ``sparsekv.loader.Checkpoint`` to use instead of loading
            ``config.model.model`` (tests with tiny random models).
    """
    if config.parallel.tensor_parallel_size > 1:
        from sparsekv.distributed.tp_launch import build_tensor_parallel_parts

        return build_tensor_parallel_parts(config, checkpoint)
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    # Chosen once; the kernels compile (or load) now, never on a request.
    backend = create_backend(config.model.attention_backend, device, config.model.prefill_qk_dtype)
    logger.info("attention backend: %s", backend.name)
    _log_speculation(config.speculative)
    if device == "cpu":
        tune_host_allocator()
    if checkpoint is None:
        from sparsekv.loader import load_checkpoint

        checkpoint = load_checkpoint(
            config.model.model,
            dtype,
            tokenizer=config.model.tokenizer,
            weight_dtype=config.model.weight_dtype,
        )
    hf_config = checkpoint.hf_config
    max_model_len = model_len_of(config, hf_config)
    model = build_model(hf_config, checkpoint.state_dict, dtype, device, max_model_len)
    # Before the prepacking, which then leaves the packed layers alone.
    apply_weight_dtype(model, config.model.weight_dtype, checkpoint)
    if can_prepack(dtype, device, has_native_bf16()):
        prepack_linears(model, dtype)
    specs = model.layer_specs()
    _log_prefill_qk(backend, dtype, model.head_dim)
    memory_gib = kv_cache_gib(
        config,
        device,
        profile=lambda: profile_forward(model, backend, config.scheduler.max_num_batched_tokens),
    )
    num_pages = num_pool_pages(
        config, len(specs), model.num_kv_heads, model.head_dim, dtype, memory_gib
    )
    kv = make_kv_manager(config, model, backend, device, dtype, num_pages, max_model_len)
    tokenizer = checkpoint.tokenizer
    runner = ModelRunner(model, kv, torch.device(device), backend)
    if device.startswith("cuda") and not config.model.enforce_eager:
        # Decode-only steps replay one CUDA graph per batch bucket (docs/gpu.md).
        runner.use_static_decode(config.scheduler.max_num_seqs, max_model_len, capture=True)
    return EngineParts(
        model_name=config.model.served_model_name or checkpoint.name,
        tokenizer=tokenizer,
        hf_config=hf_config,
        model=model,
        kv=kv,
        scheduler=Scheduler(config.scheduler, kv),
        runner=runner,
        max_model_len=max_model_len,
        eos_token_ids=eos_ids_of(hf_config, tokenizer, getattr(checkpoint, "eos_token_ids", ())),
        vocab_size=hf_config.vocab_size,
        dtype=dtype,
    )


def eos_ids_of(hf_config, tokenizer, generation_eos=()) -> tuple[int, ...]:
    """Every token that ends generation: the config's, the tokenizer's and
    ``generation_config.json``'s (Llama 3.x lists ``<|eot_id|>`` there)."""
    ids = set()
    for source in (
        getattr(hf_config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
        tuple(generation_eos),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return tuple(sorted(ids))


def _log_prefill_qk(backend: AttentionBackend, dtype: torch.dtype, head_dim: int) -> None:
    """Under ``--prefill-qk-dtype int8``, one line saying whether prefill logits run in int8
    here or the flag is ignored (another backend, fp32, an AMX or non-VNNI CPU, head_dim over
    256)."""
    if not backend.prefill_qk_int8:
        return
    if backend.prefill_qk_int8_runs(dtype, head_dim):
        logger.info(
            "prefill attention: Q·K^T in int8 (AVX512-VNNI) for prompts and long chunks; "
            "short chunks over the pages and soft-capped models keep %s logits",
            dtype,
        )
    else:
        logger.warning(
            "prefill_qk_dtype int8 is ignored here: the %s backend has no int8 prefill "
            "kernel for %s with head_dim %d on this CPU and SPARSEKV_KERNEL_ISA; logits stay "
            "in the model dtype",
            backend.name,
            dtype,
            head_dim,
        )


def _log_speculation(spec: SpeculativeConfig) -> None:
    """One line saying which speculative decoding the engine runs by default and with which
    drafter settings (requests may change them)."""
    if not spec.enabled:
        logger.info("speculative decoding: off unless a request opts in")
        return
    if spec.method == "sparse_self":
        vocab = spec.draft_vocab_size or "whole"
        detail = (
            f"view {spec.draft_sink_tokens} sink + {spec.draft_recent_tokens} recent tokens, "
            f"draft vocabulary {vocab}"
        )
    else:
        detail = f"n-grams {spec.ngram_prompt_lookup_min}-{spec.ngram_prompt_lookup_max}"
    logger.info(
        "speculative decoding: %s, %d draft tokens per step, %s",
        spec.method,
        spec.num_speculative_tokens,
        detail,
    )
