"""Native paged decode over quantized pages, read in place (no dequantized copy).

``paged_decode_attention_quantized`` reads the int8 and fp8 pages of ``kv_cache.quant`` (codes
and per-slot scales); its oracle is ``attention.reference.dequantize_pool`` followed by
``torch_ref.paged_decode_attention``. ``paged_decode_attention_int4`` does the same for KIVI int4
pages (``kv_cache.storage.Int4Storage``), against ``attention.reference.dequantize_int4_pool``.
The unquantized kernel, the variant choice and the extension are in ``ops``.
"""

from __future__ import annotations

import torch

from sparsekv.attention.cpu import ops


def supports_quantized(query: torch.Tensor, kv_data: torch.Tensor, kv_scales: torch.Tensor) -> bool:
    """True when :func:`paged_decode_attention_quantized` takes these tensors: CPU, query fp32
    or bf16, contiguous int8 or float8_e4m3fn codes ``[num_pages, 2, num_kv_heads, block_size,
    head_dim]`` with contiguous fp32 scales ``[num_pages, 2, num_kv_heads, block_size]``, and a
    kernel variant for ``head_dim`` (``ops.pick_isa(head_dim, quantized=True)``)."""
    return (
        query.device.type == "cpu"
        and kv_data.device.type == "cpu"
        and kv_scales.device.type == "cpu"
        and query.dtype in ops.NATIVE_DTYPES
        and not query.requires_grad
        and kv_data.dtype in ops.QUANTIZED_DTYPES
        and kv_data.dim() == 5
        and kv_data.is_contiguous()
        and kv_scales.dtype == torch.float32
        and kv_scales.shape == kv_data.shape[:4]
        and kv_scales.is_contiguous()
        and ops.pick_isa(kv_data.shape[-1], quantized=True) is not None
    )


def supports_int4(
    query: torch.Tensor,
    codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
) -> bool:
    """True when :func:`paged_decode_attention_int4` takes these tensors: CPU, query fp32 or
    bf16, contiguous uint8 codes ``[num_pages, 2, num_kv_heads, block_size, head_dim // 2]``,
    contiguous fp16 ``key_scale`` / ``key_zero`` ``[num_pages, num_kv_heads, head_dim]`` and
    ``value_scale`` / ``value_zero`` ``[num_pages, num_kv_heads, block_size]``, and a kernel
    variant for ``head_dim`` (:func:`ops.pick_isa`)."""
    if codes.dim() != 5:
        return False
    num_pages, _, num_kv_heads, block_size, half = codes.shape
    key_shape = (num_pages, num_kv_heads, 2 * half)
    value_shape = (num_pages, num_kv_heads, block_size)
    params = ((key_scale, key_shape), (key_zero, key_shape))
    params += ((value_scale, value_shape), (value_zero, value_shape))
    return (
        query.device.type == "cpu"
        and query.dtype in ops.NATIVE_DTYPES
        and not query.requires_grad
        and query.shape[-1] == 2 * half
        and codes.device.type == "cpu"
        and codes.dtype == torch.uint8
        and codes.shape[1] == 2
        and codes.is_contiguous()
        and all(
            t.device.type == "cpu"
            and t.dtype == torch.float16
            and tuple(t.shape) == shape
            and t.is_contiguous()
            for t, shape in params
        )
        and ops.pick_isa(2 * half) is not None
    )


def paged_decode_attention_quantized(
    query: torch.Tensor,
    kv_data: torch.Tensor,
    kv_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    first_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    return_attn_mass: bool = False,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode attention reading int8 or fp8 K/V pages in place (``kv_cache.quant`` formats).

    The same attention as :func:`ops.paged_decode_attention` over the dequantized pool
    (``attention.reference.dequantize_pool``): element = code * scale of its (page, K/V, head, slot).
    The kernel takes the codes as they are stored: a slot's logit is ``q . k_codes * k_scale``
    and its value row enters with weight ``p * v_scale``.

    Args:
        query: ``[batch, num_heads, head_dim]`` fp32 or bf16.
        kv_data: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` int8 or
            float8_e4m3fn codes, contiguous.
        kv_scales: ``[num_pages, 2, num_kv_heads, block_size]`` fp32, contiguous.
        block_tables, seq_lens, scale, first_slots, sliding_window, logit_softcap,
            return_attn_mass: as :func:`ops.paged_decode_attention`.
        isa: kernel variant (default: :func:`ops.pick_isa` with ``quantized=True``: ``head_dim``
            a multiple of four times its lanes); ``avx512_amx`` runs these pools on its vector
            kernel.

    Returns:
        out, lse, mass as :func:`ops.paged_decode_attention` (a request that sees no slot gets
        a zero output and ``lse = -inf``).

    Raises:
        RuntimeError: the extension is unavailable or rejects the arguments (dtypes, a scales
            shape other than ``kv_data.shape[:4]``, a non-contiguous pool, ...).
    """
    return ops.run_paged_decode(
        "paged_decode_quantized",
        query,
        (kv_data, kv_scales),
        kv_data.shape[2],
        block_tables,
        seq_lens,
        scale,
        first_slots,
        sliding_window,
        logit_softcap,
        return_attn_mass,
        isa or ops.pick_isa(query.shape[-1], quantized=True) or "generic",
    )


def paged_decode_attention_int4(
    query: torch.Tensor,
    codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    first_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    return_attn_mass: bool = False,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decode attention reading KIVI int4 pages in place (Liu et al. 2024; ``kv_cache.quant``).

    The same attention as :func:`ops.paged_decode_attention` over the dequantized pool
    (``attention.reference.dequantize_int4_pool``): keys ``code * key_scale[c] + key_zero[c]`` per
    channel ``c`` of the page, values ``code * value_scale[j] + value_zero[j]`` per slot ``j``.
    The kernel never dequantizes: per page it scales the query by the key scales and adds
    ``q . key_zero`` to every logit, and weighs each code row by ``p * value_scale`` with
    ``sum p * value_zero`` added to every channel.

    Args:
        query: ``[batch, num_heads, head_dim]`` fp32 or bf16.
        codes: ``[num_pages, 2, num_kv_heads, block_size, head_dim // 2]`` uint8, two 4-bit
            codes per byte along ``head_dim`` (even element in the low nibble), contiguous.
        key_scale: ``[num_pages, num_kv_heads, head_dim]`` fp16, contiguous.
        key_zero: ``[num_pages, num_kv_heads, head_dim]`` fp16, contiguous.
        value_scale: ``[num_pages, num_kv_heads, block_size]`` fp16, contiguous.
        value_zero: ``[num_pages, num_kv_heads, block_size]`` fp16, contiguous.
        seq_lens: ``[batch]`` int64 logical slot counts; the engine passes whole pages (its
            partial last page stays at full precision outside the pool), but any count works.
        block_tables, scale, first_slots, sliding_window, logit_softcap, return_attn_mass: as
            :func:`ops.paged_decode_attention`.
        isa: kernel variant (default: :func:`ops.pick_isa`; ``head_dim`` a multiple of twice its
            lanes); ``avx512_amx`` runs these pools on its vector kernel.

    Returns:
        out, lse, mass as :func:`ops.paged_decode_attention` (a request that sees no slot gets
        a zero output and ``lse = -inf``).

    Raises:
        RuntimeError: the extension is unavailable or rejects the arguments (dtypes, shapes of
            the scales and zeros other than the codes imply, a non-contiguous tensor, ...).
    """
    return ops.run_paged_decode(
        "paged_decode_int4",
        query,
        (codes, key_scale, key_zero, value_scale, value_zero),
        codes.shape[2],
        block_tables,
        seq_lens,
        scale,
        first_slots,
        sliding_window,
        logit_softcap,
        return_attn_mass,
        isa or ops.pick_isa(query.shape[-1]) or "generic",
    )
