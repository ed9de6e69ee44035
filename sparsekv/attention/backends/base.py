"""The attention-backend interface: every attention, scoring and page-copy operation the engine
runs, behind one object chosen once at engine start and passed down.

Storage (``kv_cache.storage``), scoring (``compression``), compaction and the paged-attention
step context receive an ``AttentionBackend``; none of them imports a kernel. Implementations:
``TorchBackend`` (plain PyTorch, any device: the oracle), ``CpuNativeBackend`` (the C++ CPU
kernels, falling back to ``TorchBackend`` where they do not take the tensors) and, where Triton
is installed, a Triton backend (``backends.BACKENDS``).

Page layout (docs/design.md, "KV memory"): one pool tensor ``[num_pages, 2 (K, V),
num_kv_heads, block_size, head_dim]``; a (request, layer) owns a block table of page ids, and
its logical slot ``s`` lives in page ``block_table[(s - first_slot) // block_size]`` at offset
``s % block_size`` (``first_slot`` is a multiple of ``block_size``). Query head ``h`` reads KV
head ``h // (num_heads // num_kv_heads)`` (GQA). Every log-sum-exp is the natural log in fp32.

Capability checks (``supports_*``) say whether an optional fast route takes the given tensors;
callers that get ``False`` take a generic route built from the required operations (for example
a quantized pool is dequantized page by page and decoded with ``paged_decode``).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsekv.attention.cpu.memory import advise_huge_pages
from sparsekv.attention.paging import gather_kv

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


class AttentionBackend(abc.ABC):
    """One platform's attention kernels (class attribute ``name``: the ``--attention-backend``
    value that selects it).

    Tensor conventions: ``query`` ``[batch, num_heads, head_dim]`` for decode, ``[num_heads,
    num_queries, head_dim]`` for prefill and scoring; keys and values ``[num_kv_heads, n,
    head_dim]``; pools as in the module docstring. Compute dtypes are fp32, bf16 and fp16;
    accumulation and every LSE / score / mass output is fp32.
    """

    name: ClassVar[str] = ""
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

    def prepare(self) -> bool:
        """Build or load this backend's kernels now (engine start, never on a request).

        Returns:
            True when the backend's own kernels are usable; False when it will run its
            fallbacks only (it still works).
        """
        return True

    def allocate_pages(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A zeroed tensor for KV pages (codes, scales).

        On CPU (Linux) the memory is advised for transparent 2 MiB pages
        (``attention.cpu.memory``) before it is zeroed: decode reads pages in block-table
        order, scattered over the pool, and with 4 KiB pages most of those reads also miss the
        TLB. The advice takes on memory not yet touched: a pool-sized tensor gets a fresh
        mapping; a small one (below glibc's mmap threshold, 32 MiB once the engine tunes the
        allocator) may reuse heap pages, which stay 4 KiB until the kernel collapses them.
        Elsewhere it is a plain ``torch.zeros``.

        Args:
            shape: the tensor's shape (e.g. ``[num_pages, 2, num_kv_heads, block_size,
                head_dim]`` for plain pages).
            dtype: its element type (compute dtype, codes or scales).
            device: where the pages live.

        Returns:
            A contiguous zero tensor of ``shape`` and ``dtype`` on ``device``.
        """
        device = torch.device(device)
        if device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        tensor = torch.empty(shape, dtype=dtype, device=device)
        advise_huge_pages(tensor)
        return tensor.zero_()

    def step_scope(self) -> contextlib.AbstractContextManager:
        """A context manager around one step's forward within which the backend may resolve
        once what its kernels otherwise check per call (build state, a variant forced through
        the environment). The CPU backend resolves its paged-decode kernels there; prefill,
        chunk and window-score kernels still check per call. The default resolves nothing."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ decode
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

    # ------------------------------------------------------------------ prefill
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

    # ------------------------------------------------------------------ scoring
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

    # ------------------------------------------------------------------ writes
    @abc.abstractmethod
    def write_kv(
        self,
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Scatter new keys and values into their pages (in place).

        Args:
            kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` (written).
            slot_mapping: ``[num_tokens]`` int64 physical slot ``page * block_size + offset``.
            key, value: ``[num_tokens, num_kv_heads, head_dim]``, converted to the pool dtype.
        """

    def supports_kept_slots(
        self, kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> bool:
        """True when :meth:`write_kept_slots` is a one-copy fast route for these tensors."""
        return False

    @abc.abstractmethod
    def write_kept_slots(
        self,
        kv_pool: torch.Tensor,
        block_table: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kept: torch.Tensor,
    ) -> None:
        """Compact dense keys and values into pages: rows ``kept[h]`` of ``key[h]`` /
        ``value[h]`` to slots ``0 .. k - 1`` of the block table, per KV head ``h``; slots past
        ``k`` in the last page are left as they were. Bytes are copied, not converted.

        Args:
            kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` (written).
            block_table: ``[>= ceil(k / block_size)]`` int64 page ids.
            key, value: ``[num_kv_heads, n, head_dim]`` in the pool's dtype.
            kept: ``[num_kv_heads, k]`` int64 row indices into ``n`` (any order).
        """

    @abc.abstractmethod
    def move_slots(
        self,
        kv_pool: torch.Tensor,
        source: torch.Tensor,
        target: torch.Tensor,
        kept: torch.Tensor,
    ) -> None:
        """Move the kept slots of each (layer, KV head) to slots ``0 .. k - 1`` of its target
        pages (decode-time compaction in place).

        Args:
            kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` (written).
            source: ``[layers, >= num_blocks]`` int64 pages holding the slots ``kept`` indexes.
            target: ``[layers, >= ceil(k / block_size)]`` int64 pages to write: fresh pages, or
                ``source``'s own first pages (in place).
            kept: ``[layers, num_kv_heads, k]`` int64 slot indices, ascending per row (what
                makes the in-place move safe); slot ``j`` of the result is ``kept[..., j]``.
        """

    # ------------------------------------------------------------------ selection
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
