"""Attention entry points of the model runner: native CPU kernels where they apply, else the
plain-PyTorch reference (``torch_ref``), with identical signatures and results.

Call :func:`prepare_native_kernels` at engine start so the C++ extension is compiled (or loaded
from its cache) before the first request; a failed build warns once and everything falls back
to the reference. ``SPARSEKV_DISABLE_NATIVE=1`` forces the fallback.
"""

from __future__ import annotations

import torch

from sparsekv.attention import torch_ref
from sparsekv.attention.cpu import build
from sparsekv.attention.cpu import ops as native
from sparsekv.attention.cpu import reference as cpu_reference


def prepare_native_kernels() -> bool:
    """Build or load the native kernels now; True when they are usable."""
    return build.load_extension() is not None


def decode_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    first_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    return_attn_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Paged decode attention; arguments, shapes and results as
    ``torch_ref.paged_decode_attention`` (out ``[batch, num_heads, head_dim]``, lse
    ``[batch, num_heads]`` fp32, optional mass ``[batch, num_kv_heads, max_blocks * block_size]``).
    """
    isa = native.decode_isa(query, kv_pool)
    if isa is not None:
        return native.paged_decode_attention(
            query,
            kv_pool,
            block_tables,
            seq_lens,
            scale,
            first_slots,
            sliding_window,
            logit_softcap,
            return_attn_mass,
            isa,
        )
    return torch_ref.paged_decode_attention(
        query,
        kv_pool,
        block_tables,
        seq_lens,
        scale,
        first_slots,
        sliding_window,
        logit_softcap,
        return_attn_mass,
    )


def window_scores_paged(
    window_queries: torch.Tensor,
    lse: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    num_slots: int,
    scale: float,
) -> torch.Tensor:
    """Window scores ``[num_heads, num_slots]`` fp32 over paged keys; arguments and semantics
    as ``cpu.reference.window_scores_paged``."""
    if native.supports(window_queries, kv_pool):
        return native.window_scores_paged(
            window_queries, lse, kv_pool, block_table, num_slots, scale
        )
    return cpu_reference.window_scores_paged(
        window_queries, lse, kv_pool, block_table, num_slots, scale
    )


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention with the log-sum-exp of every query row; same arguments and results as
    ``torch_ref.attention_with_lse`` (query ``[num_heads, num_queries, head_dim]``, key/value
    ``[num_kv_heads, num_keys, head_dim]``; out in the query dtype, lse fp32).

    Without soft-cap, bf16 inputs go to the native flash kernel (``native.prefill_attention``,
    on AMX tiles, AVX512-BF16 dot products or fp32 FMAs, whichever this CPU runs fastest: GQA
    without expanding K/V, causal blocks and blocks outside a sliding window skipped, any number
    of queries up to the keys, so chunked prefill too) where ``native.supports_prefill`` says it
    runs. Otherwise, when the queries are all the keys (a whole prompt), PyTorch's flash kernel
    runs with ``is_causal`` instead of a materialised ``n x n`` float mask: the same result
    (bit-identical), about twice as fast for a 4k-token prompt on 2 cores, and no ``n x n``
    allocation. Chunked prefill (fewer queries than keys) then keeps the masked path, because
    ``is_causal`` aligns the diagonal to the top-left corner.
    """
    if logit_softcap is None and native.supports_prefill(query, key, value):
        return native.prefill_attention(query, key, value, scale, sliding_window)
    num_heads, num_queries, _ = query.shape
    num_kv_heads, num_keys, _ = key.shape
    if (
        num_queries == num_keys
        and num_queries > 0
        and sliding_window is None
        and logit_softcap is None
        and query.dtype in (torch.float32, torch.bfloat16)
        and query.device.type == "cpu"
    ):
        group = num_heads // num_kv_heads
        if group > 1:
            key = key.repeat_interleave(group, dim=0)
            value = value.repeat_interleave(group, dim=0)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query[None],
            key.to(query.dtype)[None],
            value.to(query.dtype)[None],
            is_causal=True,
            scale=scale,
        )[:2]
        return out[0], lse[0].float()
    return torch_ref.attention_with_lse(query, key, value, scale, sliding_window, logit_softcap)
