"""The Triton attention backend (``--attention-backend triton``): the GPU kernels of
``attention.triton`` behind the ``AttentionBackend`` interface.

Operations with a Triton kernel: paged decode over plain and int8 / fp8 pages (with LSE and
attention mass), prefill / chunk attention with LSE (PyTorch's flash kernel on CUDA where it
applies), chunk attention reading the earlier keys from the pages in place, window scores
over dense keys and over pages, KV write, kept-slot write and slot moves. Operations without
one are inherited, unchanged, from the reference backend (``TorchBackend``), which runs on
any device:

- ``paged_decode_int4`` (KIVI int4 pages are dequantized page by page, then decoded);
- ``kept_indices`` (``torch.topk``-style selection, already a device op).

The kernels take CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before
``triton`` was imported (Triton's interpreter: how the backend is tested without a GPU);
anything else raises ``ValueError`` instead of silently running elsewhere.
"""

from __future__ import annotations

import torch

from sparsekv.attention.backends.decode_ops import DecodeParams, DecodeResult
from sparsekv.attention.backends.torch_backend import TorchBackend
from sparsekv.attention.triton import decode, kv_write, prefill, prefill_paged, window_scores
from sparsekv.attention.triton.common import interpreted

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)


class TritonBackend(TorchBackend):
    """Triton kernels for every operation that has one; the reference for the others."""

    name = "triton"

    def prepare(self) -> bool:
        """Check that the kernels can run here (they compile at their first launch).

        Raises:
            ValueError: no CUDA device and no interpreter.
        """
        if not (torch.cuda.is_available() or interpreted()):
            raise ValueError(
                "attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 set "
                "before triton is imported, to interpret the kernels on the CPU)"
            )
        return True

    # ------------------------------------------------------------------ decode
    def paged_decode(
        self, query: torch.Tensor, kv_pool: torch.Tensor, params: DecodeParams
    ) -> DecodeResult:
        return decode.paged_decode_attention(query, kv_pool, *params.kernel_args())

    def supports_quantized_decode(
        self, query: torch.Tensor, kv_data: torch.Tensor, kv_scales: torch.Tensor
    ) -> bool:
        return (
            query.dtype in FLOAT_DTYPES
            and kv_data.dtype in CODE_DTYPES
            and kv_scales.dtype == torch.float32
            and kv_scales.shape == kv_data.shape[:4]
            and _runs_here(query, kv_data, kv_scales)
        )

    def paged_decode_quantized(
        self,
        query: torch.Tensor,
        kv_data: torch.Tensor,
        kv_scales: torch.Tensor,
        params: DecodeParams,
    ) -> DecodeResult:
        return decode.paged_decode_attention_quantized(
            query, kv_data, kv_scales, *params.kernel_args()
        )

    # ------------------------------------------------------------------ prefill
    def prefill_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return prefill.attention_with_lse(
            query, key.to(query.dtype), value.to(query.dtype), scale, sliding_window, logit_softcap
        )

    def prefill_attention_paged(
        self, query, key, value, kv_pool, block_table, num_cached, scale, sliding_window=None,
        logit_softcap=None,
    ):  # fmt: skip
        """The chunk kernel reading the earlier keys from the pages in place (float pages on
        a device the kernels take; the gathering default otherwise)."""
        if kv_pool.dtype not in FLOAT_DTYPES or not _runs_here(query, key, kv_pool):
            return super().prefill_attention_paged(
                query, key, value, kv_pool, block_table, num_cached, scale, sliding_window,
                logit_softcap,
            )  # fmt: skip
        return prefill_paged.chunk_attention_paged(
            query, key, value, kv_pool, block_table, num_cached, scale, sliding_window,
            logit_softcap,
        )  # fmt: skip

    # ------------------------------------------------------------------ scoring
    def window_scores(
        self, keys, window_queries, window_lse, scale, logit_softcap=None, reduce="sum"
    ):
        """The Triton kernel sums; the ``max`` reduction (KVzip) runs on the reference."""
        if reduce != "sum":
            return super().window_scores(
                keys, window_queries, window_lse, scale, logit_softcap, reduce
            )
        scores, _ = window_scores.window_scores_dense(
            window_queries, keys, window_lse, scale, logit_softcap
        )
        return scores

    def supports_window_scores_paged(
        self, window_queries: torch.Tensor, kv_pool: torch.Tensor
    ) -> bool:
        return (
            window_queries.dtype in FLOAT_DTYPES
            and kv_pool.dtype in FLOAT_DTYPES
            and kv_pool.stride(-1) == 1
            and _runs_here(window_queries, kv_pool)
        )

    def window_scores_paged(self, window_queries, kv_pool, tables, num_slots, lse, scale):
        return window_scores.window_scores_paged(
            window_queries, lse, kv_pool, tables, num_slots, scale
        )

    # ------------------------------------------------------------------ writes
    def write_kv(self, kv_pool, slot_mapping, key, value) -> None:
        kv_write.write_kv(kv_pool, slot_mapping, key, value)

    def supports_kept_slots(
        self, kv_pool: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> bool:
        return (
            key.dtype == value.dtype == kv_pool.dtype
            and kv_pool.stride(-1) == key.stride(-1) == value.stride(-1) == 1
            and _runs_here(kv_pool, key, value)
        )

    def write_kept_slots(self, kv_pool, block_table, key, value, kept) -> None:
        kv_write.write_kept_slots(kv_pool, block_table, key, value, kept)

    def move_slots(self, kv_pool, source, target, kept) -> None:
        kv_write.move_slots(kv_pool, source, target, kept)


def _runs_here(*tensors: torch.Tensor) -> bool:
    """True when the kernels take these tensors: one CUDA device, or the CPU under the
    interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    device = devices.pop()
    return device.type == "cuda" or (device.type == "cpu" and interpreted())
