"""The decode operations of the attention-backend interface (``AttentionBackend``), with the
arguments and the result of a paged decode call.

One query token per request attends over its paged K/V in place: over full-precision pages
(required), and over int8 / fp8 or KIVI int4 pages where a backend has such a kernel (optional,
each behind a ``supports_*`` check). ``AttentionBackend`` inherits these; implementations
subclass ``AttentionBackend``, not this class. ``DecodeParams`` (what a call needs besides the
query and the pages) and ``DecodeResult`` (its out, lse, mass) are plain data that the storage
layer and the runner build and read (import them from ``attention.backends``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

# (out, lse, mass) of a paged decode: see ``AttentionBackend.paged_decode``.
DecodeResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class DecodeParams:
    """Everything a paged decode call needs besides the query and the pages.

    Attributes:
        block_tables: ``[batch, max_blocks]`` int64 page ids (indices into the pool tensor the
            call reads); padding entries may be any valid page id, they are masked.
        seq_lens: ``[batch]`` int64 logical slot count ``num_slots`` of each request after the
            new token's write (the new token included).
        scale: softmax scale (usually ``head_dim ** -0.5``).
        first_slots: ``[batch]`` int64 logical slot of each request's first held page
            (sliding-window layers free leading pages); ``None`` means 0 for every request.
        sliding_window: keys each query sees, itself included (slots), or ``None`` for all.
        logit_softcap: ``cap`` of the tanh soft-cap ``cap * tanh(logit / cap)`` applied to the
            scaled logits (Gemma 2), or ``None``.
        return_attn_mass: also return each held slot's attention probability summed over the
            query heads of its KV group (H2O accumulates it).
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    first_slots: torch.Tensor | None = None
    sliding_window: int | None = None
    logit_softcap: float | None = None
    return_attn_mass: bool = False

    def kernel_args(self) -> tuple:
        """The fields in declaration order: the positional arguments that every paged decode
        kernel takes after the query and the pages (``torch_ref.paged_decode_attention``)."""
        return (
            self.block_tables,
            self.seq_lens,
            self.scale,
            self.first_slots,
            self.sliding_window,
            self.logit_softcap,
            self.return_attn_mass,
        )


class DecodeOps(abc.ABC):
    """Paged decode over plain, int8 / fp8 and int4 pages (conventions: ``AttentionBackend``)."""

    @abc.abstractmethod
    def paged_decode(
        self, query: torch.Tensor, kv_pool: torch.Tensor, params: DecodeParams
    ) -> DecodeResult:
        """One query token per request attending over its paged K/V in place.

        Args:
            query: ``[batch, num_heads, head_dim]`` (the new token's K/V are already in the
                pool), fp32 / bf16 / fp16.
            kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` in the query's
                dtype (or any float dtype for the reference).
            params: block tables, slot counts, scale and options (:class:`DecodeParams`).

        Returns:
            out ``[batch, num_heads, head_dim]`` in the query dtype; lse ``[batch, num_heads]``
            fp32; mass ``[batch, num_kv_heads, max_blocks * block_size]`` fp32 over held slots
            (zero past each request's held count) when ``params.return_attn_mass``, else
            ``None``. A batch of 0 returns empty tensors of those shapes (mass width 0).
        """

    def supports_quantized_decode(
        self, query: torch.Tensor, kv_data: torch.Tensor, kv_scales: torch.Tensor
    ) -> bool:
        """True when :meth:`paged_decode_quantized` reads these int8 / fp8 pages in place."""
        return False

    def paged_decode_quantized(
        self,
        query: torch.Tensor,
        kv_data: torch.Tensor,
        kv_scales: torch.Tensor,
        params: DecodeParams,
    ) -> DecodeResult:
        """:meth:`paged_decode` over int8 or fp8 pages (``kv_cache.quant``) read in place:
        element = code * scale of its (page, K/V, head, slot).

        Args:
            query: ``[batch, num_heads, head_dim]`` fp32 / bf16.
            kv_data: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` int8 or
                float8_e4m3fn codes.
            kv_scales: ``[num_pages, 2, num_kv_heads, block_size]`` fp32.
            params: as :meth:`paged_decode`.

        Returns:
            As :meth:`paged_decode`.

        Raises:
            NotImplementedError: the backend has no such kernel (check
                :meth:`supports_quantized_decode` first).
        """
        raise NotImplementedError(f"{type(self).__name__} has no int8/fp8 decode kernel")

    def supports_int4_decode(self, query: torch.Tensor, *pages: torch.Tensor) -> bool:
        """True when :meth:`paged_decode_int4` reads these KIVI int4 pages in place
        (``pages``: codes, key_scale, key_zero, value_scale, value_zero)."""
        return False

    def paged_decode_int4(
        self,
        query: torch.Tensor,
        codes: torch.Tensor,
        key_scale: torch.Tensor,
        key_zero: torch.Tensor,
        value_scale: torch.Tensor,
        value_zero: torch.Tensor,
        params: DecodeParams,
    ) -> DecodeResult:
        """:meth:`paged_decode` over KIVI int4 pages read in place (Liu et al. 2024): keys
        ``code * key_scale[c] + key_zero[c]`` per channel of a page, values ``code *
        value_scale[j] + value_zero[j]`` per slot.

        Args:
            query: ``[batch, num_heads, head_dim]`` fp32 / bf16.
            codes: ``[num_pages, 2, num_kv_heads, block_size, head_dim // 2]`` uint8, two codes
                per byte (even element in the low nibble).
            key_scale, key_zero: ``[num_pages, num_kv_heads, head_dim]`` fp16.
            value_scale, value_zero: ``[num_pages, num_kv_heads, block_size]`` fp16.
            params: as :meth:`paged_decode` (``sliding_window`` and ``return_attn_mass`` are
                not used by the engine on this path).

        Returns:
            As :meth:`paged_decode`.

        Raises:
            NotImplementedError: the backend has no such kernel.
        """
        raise NotImplementedError(f"{type(self).__name__} has no int4 decode kernel")
