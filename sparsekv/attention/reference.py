"""Plain-PyTorch oracles of native kernels without a ``torch_ref`` counterpart: window scores
over paged keys, and the dequantized pools that quantized decode is checked against (int8 /
fp8: ``dequantize_pool``; KIVI int4: ``dequantize_int4_pool``).

The reference backend (``backends.TorchBackend``) runs them; the kernel tests compare against
them.
"""

from __future__ import annotations

import torch

from sparsekv.attention.torch_ref import causal_mask, gather_kv
from sparsekv.kv_cache import quant


def window_scores_paged(
    window_queries: torch.Tensor,
    lse: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    num_slots: int,
    scale: float,
) -> torch.Tensor:
    """Attention each held slot receives from the observation window (SnapKV's score, docs/compression.md).

    ``out[h, j] = sum_i exp(q_i . k_j * scale - lse_i)`` over window rows ``i`` that see slot
    ``j``: row ``i`` is the query of slot ``num_slots - window + i`` and sees slots up to it.

    Args:
        window_queries: ``[num_heads, window, head_dim]`` (fp32 or bf16), ``window <= num_slots``.
        lse: ``[num_heads, window]`` fp32 natural-log sum of exp of each row's logits.
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``.
        block_table: ``[num_blocks]`` int64 page ids of the layer, slot 0 first.
        num_slots: held slots.
        scale: softmax scale.

    Returns:
        ``[num_heads, num_slots]`` fp32 scores per query head (not aggregated over a group).
    """
    num_heads, window, _ = window_queries.shape
    num_kv_heads = kv_pool.shape[2]
    keys, _ = gather_kv(kv_pool, block_table, num_slots)  # [kvh, num_slots, d]
    keys = keys.float().repeat_interleave(num_heads // num_kv_heads, dim=0)
    logits = torch.matmul(window_queries.float(), keys.transpose(-1, -2)) * scale
    probs = torch.exp(logits - lse.float()[..., None])  # [num_heads, window, num_slots]
    visible = causal_mask(window, num_slots, device=probs.device)
    return probs.masked_fill(~visible, 0.0).sum(dim=1)


def dequantize_pool(
    kv_data: torch.Tensor, kv_scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The pool an int8 or fp8 page store stands for (``kv_cache.quant``).

    ``torch_ref.paged_decode_attention(query, dequantize_pool(data, scales), ...)`` is the
    oracle of ``quant_decode.paged_decode_attention_quantized(query, data, scales, ...)``.

    Args:
        kv_data: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` int8 or float8_e4m3fn
            codes.
        kv_scales: ``[num_pages, 2, num_kv_heads, block_size]`` fp32, one per slot.
        dtype: result dtype; fp32 (the default) holds ``code * scale`` as the kernel computes it.

    Returns:
        ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` ``code * scale`` in ``dtype``.

    Raises:
        ValueError: ``kv_scales`` is not ``kv_data.shape[:4]``.
    """
    if kv_scales.shape != kv_data.shape[:4]:
        raise ValueError(
            f"kv_scales must have shape {tuple(kv_data.shape[:4])}, got {tuple(kv_scales.shape)}"
        )
    return (kv_data.float() * kv_scales.float()[..., None]).to(dtype)


def dequantize_int4_pool(
    codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The pool KIVI int4 pages stand for (``kv_cache.quant``; Liu et al. 2024).

    ``torch_ref.paged_decode_attention(query, dequantize_int4_pool(...), ...)`` is the oracle of
    ``quant_decode.paged_decode_attention_int4(query, codes, key_scale, ..., value_zero, ...)``.

    Args:
        codes: ``[num_pages, 2, num_kv_heads, block_size, head_dim // 2]`` uint8, two codes per
            byte (even element in the low nibble).
        key_scale: ``[num_pages, num_kv_heads, head_dim]`` fp16, per channel of a page.
        key_zero: ``[num_pages, num_kv_heads, head_dim]`` fp16.
        value_scale: ``[num_pages, num_kv_heads, block_size]`` fp16, per slot.
        value_zero: ``[num_pages, num_kv_heads, block_size]`` fp16.
        dtype: result dtype; fp32 (the default) holds ``code * scale + zero`` as computed.

    Returns:
        ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` in ``dtype``.

    Raises:
        ValueError: a scale or zero's shape is not the one ``codes`` implies.
    """
    num_pages, _, num_kv_heads, block_size, half = codes.shape
    key_shape = (num_pages, num_kv_heads, 2 * half)
    value_shape = (num_pages, num_kv_heads, block_size)
    for name, tensor, shape in (
        ("key_scale", key_scale, key_shape),
        ("key_zero", key_zero, key_shape),
        ("value_scale", value_scale, value_shape),
        ("value_zero", value_zero, value_shape),
    ):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    keys = quant.dequantize_int4_keys(codes[:, 0], key_scale, key_zero, dtype)
    values = quant.dequantize_int4_values(codes[:, 1], value_scale, value_zero, dtype)
    return torch.stack((keys, values), dim=1)
