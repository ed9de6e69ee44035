"""The native CPU backend: the C++ kernels of ``attention/cpu`` (and the fused KV write of
``models/fused``), each used where it takes the tensors; everything else falls back to the
PyTorch reference (``TorchBackend``), with identical results.

``prepare`` compiles (or loads from its cache) the extension at engine start; a failed build
warns once and every call falls back. ``SPARSEKV_DISABLE_NATIVE=1`` makes ``prepare`` report
False, so ``--attention-backend auto`` picks the reference backend instead.
"""

from __future__ import annotations

import torch

from sparsekv.attention.backends import cpu_window
from sparsekv.attention.backends.decode_ops import DecodeParams, DecodeResult
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.attention.cpu import (
    build,
    chunk_paged,
    kept_slots,
    prefill_ops,
    quant_decode,
    window_fused,
)
from sparsekv.attention.cpu import ops as native
from sparsekv.ext_cache import ExtensionScope
from sparsekv.models.fused import ops as fused


class CpuNativeBackend(TorchBackend):
    """The C++ CPU kernels: paged decode (plain, int8 / fp8, int4 pages), flash prefill,
    chunks over the pages (one sequence or a ragged batch), window scores (fused AMX / AVX512-BF16, or the paged kernel), kept-slot writes, slot moves
    and kept-index selection."""

    name = "cpu"
    batches_paged_chunks = True

    def prepare(self) -> bool:
        return build.load_extension() is not None

    def prefill_qk_int8_runs(self, dtype: torch.dtype, head_dim: int) -> bool:
        """bf16 with ``head_dim`` up to 256 on the AVX512-BF16 prefill kernel with AVX512-VNNI
        (``prefill_ops.prefill_qk_int8_runs``), for prompts and long chunks: short chunks
        read from the pages (``chunk_paged``) and soft-capped models keep their logits."""
        return prefill_ops.prefill_qk_int8_runs(dtype, head_dim=head_dim)

    def step_scope(self) -> ExtensionScope:
        """The extension and ``SPARSEKV_KERNEL_ISA`` resolved once for the step (a decode step
        picks a variant for each of its layers)."""
        return native.native_scope()

    def paged_decode(
        self, query: torch.Tensor, kv_pool: torch.Tensor, params: DecodeParams
    ) -> DecodeResult:
        isa = native.decode_isa(query, kv_pool)
        if isa is None:
            return super().paged_decode(query, kv_pool, params)
        return native.paged_decode_attention(query, kv_pool, *params.kernel_args(), isa)

    def supports_quantized_decode(self, query, kv_data, kv_scales) -> bool:
        return quant_decode.supports_quantized(query, kv_data, kv_scales)

    def paged_decode_quantized(self, query, kv_data, kv_scales, params) -> DecodeResult:
        return quant_decode.paged_decode_attention_quantized(
            query, kv_data, kv_scales, *params.kernel_args()
        )

    def supports_int4_decode(self, query, *pages) -> bool:
        return quant_decode.supports_int4(query, *pages)

    def paged_decode_int4(
        self, query, codes, key_scale, key_zero, value_scale, value_zero, params
    ) -> DecodeResult:
        return quant_decode.paged_decode_attention_int4(
            query, codes, key_scale, key_zero, value_scale, value_zero, *params.kernel_args()
        )

    def prefill_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Without soft-cap, bf16 and fp32 inputs go to the native flash kernel
        (``prefill_ops.prefill_attention``: AMX tiles, AVX512-BF16 dot products or fp32 FMAs for
        bf16, fp32 FMAs for fp32, whichever this CPU runs fastest; GQA without expanding K/V,
        causal blocks and blocks outside a sliding window skipped, any number of queries up to
        the keys) where ``prefill_ops.supports_prefill`` says it runs, with int8 logits under
        ``prefill_qk_int8`` where ``prefill_ops.prefill_qk_int8_runs``; else the reference
        backend's route."""
        if logit_softcap is None and prefill_ops.supports_prefill(query, key, value):
            return prefill_ops.prefill_attention(
                query, key, value, scale, sliding_window, qk_int8=self.prefill_qk_int8
            )
        return super().prefill_attention(query, key, value, scale, sliding_window, logit_softcap)

    def prefill_attention_paged(
        self, query, key, value, kv_pool, block_table, num_cached, scale, sliding_window=None,
        logit_softcap=None,
    ):  # fmt: skip
        """The multi-query kernel reading the held slots from the pages in place
        (``chunk_paged``: fp32 / bf16 pages, GQA, sliding window) where
        ``chunk_paged.supports_chunk_paged`` says it takes the tensors (not soft-capped); else
        the gathering default, also for long chunks over bf16 pages, where the flash prefill
        kernel over the gathered keys is faster (``chunk_paged.beats_gather``)."""
        if chunk_paged.supports_chunk_paged(
            query, key, kv_pool, logit_softcap
        ) and chunk_paged.beats_gather(kv_pool, query.shape[1], query.shape[0]):
            return chunk_paged.chunk_attention_paged(
                query, key, value, kv_pool, block_table, num_cached, scale, sliding_window
            )
        return super().prefill_attention_paged(
            query, key, value, kv_pool, block_table, num_cached, scale, sliding_window,
            logit_softcap,
        )  # fmt: skip

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
        """:meth:`prefill_attention_paged` of several sequences in one kernel call (a ragged
        batch: ``chunk_paged.chunk_attention_paged_batch``, whose arguments these are), or
        ``None`` where the kernel does not take the tensors or is not the faster route
        (``chunk_paged.beats_gather``): the caller then goes per sequence."""
        if not chunk_paged.supports_chunk_paged(query, key, kv_pool, logit_softcap):
            return None
        if not chunk_paged.beats_gather(kv_pool, int(row_starts.diff().max()), query.shape[0]):
            return None
        return chunk_paged.chunk_attention_paged_batch(
            query, key, value, kv_pool, block_tables, row_starts, num_cached, scale,
            sliding_window,
        )  # fmt: skip

    def window_scores(
        self, keys, window_queries, window_lse, scale, logit_softcap=None, reduce="sum"
    ):
        """bf16, and fp32 on the fp32-FMA variants, run the fused kernel (``window_fused``: the
        LSE, when not given, and the sums in one pass); the rest the paged window kernel
        (``cpu_window``) when it takes the tensors; a soft-capped model, the ``max`` reduction (the kernels only sum) and the
        rest the reference (the kernels do not cap)."""
        if logit_softcap is not None or reduce != "sum":
            return super().window_scores(
                keys, window_queries, window_lse, scale, logit_softcap, reduce
            )
        if cpu_window.fused_window_ready(keys, window_queries):
            lse = None if window_lse is None else window_lse.float().contiguous()
            return window_fused.window_scores_fused(window_queries, keys, lse, scale)[0]
        if cpu_window.native_window_ready(keys, window_queries):
            return cpu_window.native_window_scores(keys, window_queries, window_lse, scale)
        return super().window_scores(keys, window_queries, window_lse, scale)

    def supports_window_scores_paged(self, window_queries, kv_pool) -> bool:
        return window_fused.supports_window_fused(window_queries, kv_pool)

    def window_scores_paged(self, window_queries, kv_pool, tables, num_slots, lse, scale):
        """The fused kernel where it takes the tensors; with the LSE given, the paged window
        kernel (``ops.window_scores_paged``, one call per layer); else the reference."""
        if window_fused.supports_window_fused(window_queries, kv_pool):
            return window_fused.window_scores_fused_paged(
                window_queries, kv_pool, tables.contiguous(), num_slots, lse, scale
            )
        if lse is None or not native.supports(window_queries, kv_pool):
            return super().window_scores_paged(
                window_queries, kv_pool, tables, num_slots, lse, scale
            )
        heads = window_queries.shape[0] // tables.shape[0]
        lse = lse.float()
        scores = [
            native.window_scores_paged(
                window_queries[rows], lse[rows], kv_pool, tables[layer], num_slots, scale
            )
            for layer in range(tables.shape[0])
            for rows in (slice(layer * heads, (layer + 1) * heads),)
        ]
        return torch.cat(scores), lse

    def write_kv(self, kv_pool, slot_mapping, key, value) -> None:
        """One native call (``models/fused``) where it applies: a contiguous CPU pool, keys and
        values of the pool's dtype with a contiguous last dimension."""
        fused.write_kv_(kv_pool, slot_mapping, key, value)

    def supports_kept_slots(self, kv_pool, key, value) -> bool:
        return kept_slots.supports_kept_slots(kv_pool, key, value)

    def write_kept_slots(self, kv_pool, block_table, key, value, kept) -> None:
        if not kept_slots.supports_kept_slots(kv_pool, key, value):
            super().write_kept_slots(kv_pool, block_table, key, value, kept)
            return
        kept_slots.write_kept_slots(kv_pool, block_table, key, value, kept)

    def move_slots(self, kv_pool, source, target, kept) -> None:
        """Row copies in C++, one item per (layer, KV head) (``csrc/compaction_binding.cpp``)."""
        ext = build.load_extension()
        if ext is None or not kv_pool.is_cpu:
            super().move_slots(kv_pool, source, target, kept)
            return
        ext.move_slots_(kv_pool, source.contiguous(), target.contiguous(), kept.contiguous())

    def kept_indices(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """The rule per row in C++ (nth_element, then one pass: ~0.1 ms against ~1.4 ms) for
        CPU fp32 scores; the reference otherwise."""
        rows, m = scores.shape
        ext = build.load_extension()
        if (
            0 < k < m
            and rows
            and ext is not None
            and scores.device.type == "cpu"
            and scores.dtype == torch.float32
        ):
            return ext.kept_indices_prefer_recent(scores.contiguous(), k)
        return super().kept_indices(scores, k)
