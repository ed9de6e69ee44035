"""How much memory the KV cache gets when ``--kv-cache-memory`` is not given.

- CPU: the fixed default (``config.CPU_KV_CACHE_MEMORY``, 2 GiB); ``num_pool_pages`` then
  refuses a size above 80% of the available RAM, as for a given size.
- CUDA (vLLM's ``--gpu-memory-utilization``): the model runs one profiling forward over a full
  step (``max_num_batched_tokens`` tokens, no cache), and the KV cache gets
  ``total * utilization`` minus what the device holds after it (weights, other processes)
  minus the forward's peak activations.

A given ``--kv-cache-memory`` always wins.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sparsekv.attention.backends import AttentionBackend
from sparsekv.config import CPU_KV_CACHE_MEMORY, EngineConfig

GIB = 1 << 30


def kv_cache_gib(
    config: EngineConfig,
    device: str,
    profile: Callable[[], None] | None = None,
    mem_info: Callable[[], tuple[int, int]] | None = None,
    peak_activation_bytes: Callable[[], int] | None = None,
) -> float:
    """GiB of KV memory for this engine, all of it pages (``engine_setup.num_pool_pages``).

    Args:
        config: the engine configuration (``cache.kv_cache_memory``,
            ``cache.gpu_memory_utilization``).
        device: the resolved device (``cpu``, ``cuda``, ``cuda:N``).
        profile: runs the profiling forward (CUDA only).
        mem_info: ``(free, total)`` device bytes after the forward (default
            ``torch.cuda.mem_get_info``); a parameter so the rule is testable without a GPU.
        peak_activation_bytes: the forward's peak bytes above what stays allocated (default
            from ``torch.cuda.max_memory_allocated``).

    Raises:
        ValueError: on CUDA, the utilization leaves no memory for the KV cache.
    """
    if config.cache.kv_cache_memory is not None:
        return config.cache.kv_cache_memory
    if not device.startswith("cuda"):
        return CPU_KV_CACHE_MEMORY
    if profile is not None:
        if peak_activation_bytes is None:
            torch.cuda.reset_peak_memory_stats(device)
        profile()
    if mem_info is None:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
    else:
        free, total = mem_info()
    if peak_activation_bytes is None:
        peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    else:
        peak = peak_activation_bytes()
    utilization = config.cache.gpu_memory_utilization
    available = total * utilization - (total - free) - peak
    if available <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {utilization} of {total / GIB:.1f} GiB leaves no memory "
            f"for the KV cache ({(total - free) / GIB:.1f} GiB in use, "
            f"{peak / GIB:.1f} GiB peak activations); raise it or pass --kv-cache-memory"
        )
    return available / GIB


class ProfilingContext:
    """A cache-less attention context for the profiling forward: every layer attends its
    tokens causally as one prompt (the model's ``ctx`` argument; nothing is written).

    Args:
        backend: the engine's attention backend.
    """

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``[num_tokens, num_heads, head_dim]`` causal attention of the tokens over themselves."""
        out, _ = self.backend.prefill_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, sliding_window
        )
        return out.transpose(0, 1)

    def finish(self) -> None:
        """Nothing to finish (the interface of the step context)."""


def profile_forward(model: torch.nn.Module, backend: AttentionBackend, num_tokens: int) -> None:
    """One forward over ``num_tokens`` dummy tokens (token 0 at positions ``0 ..``)."""
    device = next(model.parameters()).device
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    with torch.inference_mode():
        model(ids, positions, ProfilingContext(backend))
