"""The scoring and selection operations of the attention-backend interface (``AttentionBackend``).

Compression ranks held slots by the attention an observation window of queries pays them
(SnapKV's window scores, over dense keys or read from the pages in place) and keeps the top
``k`` per row. ``AttentionBackend`` inherits these; implementations subclass
``AttentionBackend``, not this class.
"""

from __future__ import annotations

import abc

import torch


class ScoringOps(abc.ABC):
    """Window scores and top-``k`` selection (tensor conventions: ``AttentionBackend``)."""

    @abc.abstractmethod
    def window_scores(
        self,
        keys: torch.Tensor,
        window_queries: torch.Tensor,
        window_lse: torch.Tensor | None,
        scale: float,
        logit_softcap: float | None = None,
        reduce: str = "sum",
    ) -> torch.Tensor:
        """SnapKV's observation-window scores over dense keys: ``S_h[j] = sum_i exp(l_ij -
        lse_i)`` over window rows ``i`` that see slot ``j`` (row ``i`` is the query of slot
        ``n - w + i``), ``l_ij = q_i . k_j * scale`` (soft-capped when asked); with ``reduce
        = "max"`` the largest weight instead of the sum (KVzip's reconstruction rows).

        Args:
            keys: ``[num_kv_heads, n, head_dim]``.
            window_queries: ``[num_heads, w, head_dim]``, ``w <= n``.
            window_lse: ``[num_heads, w]`` fp32 LSE of those rows over the slots each sees (from
                the attention), or ``None`` to compute it.
            scale: softmax scale.
            logit_softcap: the model's soft-cap, or ``None``.
            reduce: ``sum`` or ``max`` over the rows. Backends whose kernels only sum run
                ``max`` on the PyTorch reference (``torch_ref.attention_mass_per_head``,
                chunked over rows).

        Returns:
            ``[num_heads, n]`` fp32 per query head (not pooled or GQA-aggregated).

        Raises:
            ValueError: ``reduce`` is neither ``sum`` nor ``max``.
        """

    def supports_window_scores_paged(
        self, window_queries: torch.Tensor, kv_pool: torch.Tensor
    ) -> bool:
        """True when :meth:`window_scores_paged` and :meth:`move_slots` are the fast route for
        these tensors (decode-time compaction straight from the pages); False sends the
        caller to gather, score densely and write."""
        return False

    @abc.abstractmethod
    def window_scores_paged(
        self,
        window_queries: torch.Tensor,
        kv_pool: torch.Tensor,
        tables: torch.Tensor,
        num_slots: int,
        lse: torch.Tensor | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`window_scores` with the keys read from pages in place, for several layers'
        block tables at once (their heads stacked layer-major); no soft-cap.

        Args:
            window_queries: ``[layers * num_heads, w, head_dim]``.
            kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``.
            tables: ``[layers, >= ceil(num_slots / block_size)]`` int64 page ids, slot 0 first.
            num_slots: held slots ``n`` of every layer (``w <= n``).
            lse: ``[layers * num_heads, w]`` fp32, or ``None`` to compute it.
            scale: softmax scale.

        Returns:
            scores ``[layers * num_heads, num_slots]`` and lse ``[layers * num_heads, w]``,
            fp32 (the given lse when passed).
        """

    @abc.abstractmethod
    def kept_indices(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """The ``k`` highest scores per row, ties going to the higher (more recent) index,
        returned ascending.

        Args:
            scores: ``[rows, m]`` fp32 (NaN ranks highest, as in a sort).
            k: ``0 <= k <= m``.

        Returns:
            ``[rows, k]`` int64, ascending per row.
        """
