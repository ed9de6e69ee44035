"""The prefill operations of the attention-backend interface (``AttentionBackend``).

Causal attention of a prompt or of a chunk with every row's LSE: over dense keys (required),
over a chunk whose earlier keys are in the pages (a default that gathers them, overridden where
a kernel reads the pages in place), and over several sequences' chunks in one call (optional).
``AttentionBackend`` inherits these; implementations subclass ``AttentionBackend``, not this
class.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from sparsekv.attention.paging import gather_kv


class PrefillOps(abc.ABC):
    """Prefill and chunk attention (tensor conventions: ``AttentionBackend``)."""

    # True when :meth:`prefill_attention_paged_batch` has a batched route (callers skip
    # building its arguments otherwise).
    batches_paged_chunks: ClassVar[bool] = False
    # ``--prefill-qk-dtype int8``: prefill logits from int8 codes where the backend has such a
    # kernel (the native CPU one on AVX512-VNNI); every other backend ignores it.
    prefill_qk_int8: bool = False

    def prefill_qk_int8_runs(self, dtype: torch.dtype, head_dim: int) -> bool:
        """True when :attr:`prefill_qk_int8` would compute this backend's prefill logits of
        ``dtype`` and ``head_dim`` in int8 here; False (the default) where the backend has no
        such kernel."""
        return False

    @abc.abstractmethod
    def prefill_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of the last ``num_queries`` of ``num_keys`` positions (a prompt, or
        a chunk after its earlier keys gathered from the pages), with every row's LSE.

        Query row ``i`` sits at key ``p = num_keys - num_queries + i`` and sees keys ``j <=
        p``; with a sliding window ``w`` only ``j > p - w``.

        Args:
            query: ``[num_heads, num_queries, head_dim]``.
            key, value: ``[num_kv_heads, num_keys, head_dim]``, ``num_keys >= num_queries``,
                any float dtype (converted to the query's).
            scale: softmax scale.
            sliding_window: optional window in slots.
            logit_softcap: optional tanh soft-cap of the logits.

        Returns:
            out ``[num_heads, num_queries, head_dim]`` in the query dtype, lse ``[num_heads,
            num_queries]`` fp32.
        """

    def prefill_attention_paged(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_pool: torch.Tensor,
        block_table: torch.Tensor,
        num_cached: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`prefill_attention` of a chunk whose earlier keys are in the pages: the keys
        are the ``num_cached`` held slots of ``block_table`` followed by the chunk's own.

        This default gathers the held slots into a copy and calls :meth:`prefill_attention`;
        a backend with a kernel that reads the pages in place overrides it.

        Args:
            query: ``[num_heads, m, head_dim]`` the chunk's queries.
            key, value: ``[num_kv_heads, m, head_dim]`` the chunk's own keys and values.
            kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` float pages.
            block_table: ``[>= ceil(num_cached / block_size)]`` int64 page ids, held slot 0
                first.
            num_cached: held slots before the chunk.
            scale, sliding_window, logit_softcap: as :meth:`prefill_attention`.

        Returns:
            out ``[num_heads, m, head_dim]`` in the query dtype, lse ``[num_heads, m]`` fp32.
        """
        block_size = kv_pool.shape[3]
        pages = block_table[: -(-num_cached // block_size)]
        cached_k, cached_v = gather_kv(kv_pool, pages, num_cached)
        keys = torch.cat([cached_k, key.to(kv_pool.dtype)], dim=1)
        values = torch.cat([cached_v, value.to(kv_pool.dtype)], dim=1)
        return self.prefill_attention(query, keys, values, scale, sliding_window, logit_softcap)

    def prefill_attention_paged_batch(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_pool: torch.Tensor,
        block_tables: torch.Tensor,
        row_starts: torch.Tensor,
        num_cached: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`prefill_attention_paged` of several sequences' chunks in one call, or ``None``
        where this backend has no batched route for these tensors (the caller then calls
        :meth:`prefill_attention_paged` per sequence). This default has none
        (:attr:`batches_paged_chunks` is False).

        Args:
            query: ``[num_heads, total_rows, head_dim]`` the chunks' queries, sequence by
                sequence; key, value: ``[num_kv_heads, total_rows, head_dim]``.
            kv_pool: as :meth:`prefill_attention_paged`.
            block_tables: ``[num_seqs, max_blocks]`` int64 page ids (zero-padded).
            row_starts: ``[num_seqs + 1]`` int64 row offsets of each sequence's chunk.
            num_cached: ``[num_seqs]`` int64 held slots before each chunk.
            scale, sliding_window, logit_softcap: as :meth:`prefill_attention`.

        Returns:
            out ``[num_heads, total_rows, head_dim]`` in the query dtype and lse
            ``[num_heads, total_rows]`` fp32, or ``None``.
        """
        return None
