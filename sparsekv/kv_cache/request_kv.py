"""Per-request KV bookkeeping: a block table and slot counters for every layer.

Counters: ``num_slots`` is the logical slot count of a (request, layer)
(``first_slot`` included), distinct from the request's logical ``num_tokens``; ``first_slot`` is
the logical slot of the first page still held (sliding layers free leading pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerKV:
    """KV state of one (request, layer).

    Attributes:
        block_table: page ids, first held page first.
        num_slots: logical slots (held slots = ``num_slots - first_slot``).
        first_slot: logical slot of ``block_table[0]`` (a multiple of ``block_size``).
        num_evicted: tokens removed by compression so far.
        budget: slots kept after compression, or ``None`` for a layer that is never compressed.
        recent_queries: ``[num_heads, <= window, head_dim]`` queries of the latest tokens
            (post-RoPE), used to re-score at decode time; ``None`` for uncompressed layers
            (a property over ``remember_queries`` and the request's decode query log).
        accumulated: ``[num_kv_heads, num_held]`` fp32 attention mass per slot (H2O).
        compact_table: fresh pages allocated for a compaction in flight (copy-on-write); they
            replace ``block_table`` when the step commits.
        residual: int4 pages only: keys and values ``[num_kv_heads, num_held % block_size,
            head_dim]`` (compute dtype) of the partial last page, kept at full precision until
            the page is full and quantized (KIVI's recent tokens; ``kv_cache.storage``).
        head_lens: head-wise layers only (adaptive head budgets, after the prefill that
            compressed them): held slots of each KV head; ``num_slots`` is then their mean,
            rounded up (``kv_cache.head_pages``).
        head_pages: head-wise layers only: pages of each KV head; head ``h`` owns the
            ``head_pages[h]`` entries of ``block_table`` after those of heads ``< h``, each
            page read as one head's ``num_kv_heads * block_size`` slots.
    """

    block_table: list[int] = field(default_factory=list)
    num_slots: int = 0
    first_slot: int = 0
    num_evicted: int = 0
    budget: int | None = None
    accumulated: torch.Tensor | None = None
    compact_table: list[int] | None = None
    residual: tuple[torch.Tensor, torch.Tensor] | None = None
    head_lens: list[int] | None = None
    head_pages: list[int] | None = None
    # The window [num_heads, <= window, head_dim]; decode rows wait in the owner's log.
    _queries: torch.Tensor | None = field(default=None, repr=False)
    # The request whose query log (RequestKV.log_decode_queries) may hold rows of this layer
    # not yet merged into the window: merged before the window is read or written.
    _owner: RequestKV | None = field(default=None, repr=False, compare=False)

    @property
    def num_held(self) -> int:
        return self.num_slots - self.first_slot

    @property
    def recent_queries(self) -> torch.Tensor | None:
        self._merge_logged()
        return self._queries

    @recent_queries.setter
    def recent_queries(self, value: torch.Tensor | None) -> None:
        self._merge_logged()
        self._queries = value

    def remember_queries(self, q: torch.Tensor, window: int) -> None:
        """Keep the last ``window`` of these queries ``[m, num_heads, head_dim]`` (after the
        ones kept before)."""
        self._merge_logged()
        self._keep_window(q[-window:].transpose(0, 1), window)

    def remember_query(self, row: torch.Tensor, window: int) -> None:
        """Append one query ``[num_heads, head_dim]`` to the window (one copy of the window;
        the engine's decode path logs whole steps instead: ``RequestKV.log_decode_queries``)."""
        self.remember_queries(row[None], window)

    def _merge_logged(self) -> None:
        if self._owner is not None and self._owner._query_log:
            self._owner.merge_decode_queries()

    def _keep_window(self, new: torch.Tensor, window: int) -> None:
        """The window becomes the last ``window`` rows of the kept ones followed by ``new``
        ``[num_heads, n <= window, head_dim]``."""
        recent = self._queries
        if recent is not None and new.shape[1] < window:
            # Only the kept tail of the old window is copied (one op; the result is contiguous).
            new = torch.cat([recent[:, new.shape[1] - window :], new], dim=1)
        self._queries = new.contiguous()


@dataclass
class RequestKV:
    """All layers of one request, plus its host-side swap copy while preempted.

    Attributes:
        layers: one ``LayerKV`` per model layer.
        swapped_pages: per layer, host copies of the pages' tensors (codes, then scales for
            quantized formats; leading dimension = pages) while the request is swapped out,
            else ``None``.
        side_pages: pool pages held for the side state (``kv_cache.side_state``), from the
            first step to the end, except while swapped out (the side state then counts as
            host memory, like the K/V copies).
    """

    layers: list[LayerKV]
    swapped_pages: list[tuple[torch.Tensor, ...]] | None = None
    side_pages: list[int] = field(default_factory=list)
    # Decode steps' queries not yet merged into the layers' windows: (step queries
    # [len(layer_ids), batch, num_heads, head_dim], this request's row, layer_ids).
    _query_log: list[tuple[torch.Tensor, int, tuple[int, ...]]] = field(
        default_factory=list, repr=False, compare=False
    )
    _log_window: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        for layer in self.layers:
            layer._owner = self

    def log_decode_queries(
        self, queries: torch.Tensor, row: int, layer_ids: tuple[int, ...], window: int
    ) -> None:
        """Remember one decode step's queries of ``layer_ids`` for the layers' windows.

        The decode path calls this once per request and step with the step's queries of all
        those layers stacked (``queries[i, row]`` is layer ``layer_ids[i]``'s
        ``[num_heads, head_dim]``): one call where ``LayerKV.remember_query`` per (request,
        layer) would take 480 a step for 16 requests over 30 layers. The rows reach the
        budgeted layers' windows when one of them is read or written, or every ``window``
        steps (which bounds the step tensors kept alive).

        Args:
            queries: ``[len(layer_ids), batch, num_heads, head_dim]`` post-RoPE queries.
            row: this request's index on the batch axis.
            layer_ids: model layer of each leading index.
            window: observation window (rows each layer keeps).
        """
        self._query_log.append((queries, row, layer_ids))
        self._log_window = window
        if len(self._query_log) >= window:
            self.merge_decode_queries()

    def merge_decode_queries(self) -> None:
        """Append the logged decode queries to the windows of the budgeted layers, oldest
        first: one stack per run of steps over the same layers, then one window merge per
        layer."""
        log, window = self._query_log, self._log_window
        self._query_log = []
        start = 0
        while start < len(log):
            layer_ids = log[start][2]
            end = start + 1
            while end < len(log) and log[end][2] == layer_ids:
                end += 1
            steps = log[max(start, end - window) : end]
            rows = torch.stack([queries[:, row] for queries, row, _ in steps], dim=2)
            for i, layer in enumerate(layer_ids):  # rows[i]: [num_heads, steps, head_dim]
                state = self.layers[layer]
                if state.budget is not None:
                    state._keep_window(rows[i], window)
            start = end

    @property
    def is_swapped(self) -> bool:
        return self.swapped_pages is not None

    def kept_per_layer(self) -> list[int]:
        return [layer.num_held for layer in self.layers]

    def evicted_per_layer(self) -> list[int]:
        return [layer.num_evicted for layer in self.layers]
