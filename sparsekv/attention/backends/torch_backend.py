"""The PyTorch reference backend: every operation in plain tensor code on any device.

It is the oracle the other backends are tested against and the fallback of the native CPU
backend; ``SPARSEKV_DISABLE_NATIVE=1`` (or a CPU where the extension does not build) runs the
engine on it.
"""

from __future__ import annotations

import dataclasses

import torch

from sparsekv.attention import reference, selection, torch_ref
from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.attention.backends.decode_ops import DecodeParams, DecodeResult


class TorchBackend(AttentionBackend):
    """Plain PyTorch (``attention.torch_ref``): gathers pages and computes densely in fp32."""

    name = "torch"

    def paged_decode(
        self, query: torch.Tensor, kv_pool: torch.Tensor, params: DecodeParams
    ) -> DecodeResult:
        return torch_ref.paged_decode_attention(query, kv_pool, *params.kernel_args())

    def paged_decode_quantized(self, query, kv_data, kv_scales, params) -> DecodeResult:
        """The dequantized pool's :meth:`paged_decode` (``attention.reference.dequantize_pool``),
        over the referenced pages only."""
        pages, tables = torch.unique(params.block_tables, return_inverse=True)
        dense = reference.dequantize_pool(kv_data[pages], kv_scales[pages], torch.float32)
        return self.paged_decode(query, dense, _with_tables(params, tables))

    def paged_decode_int4(
        self, query, codes, key_scale, key_zero, value_scale, value_zero, params
    ) -> DecodeResult:
        """The dequantized pool's :meth:`paged_decode` (``attention.reference.dequantize_int4_pool``),
        over the referenced pages only."""
        pages, tables = torch.unique(params.block_tables, return_inverse=True)
        parts = (codes, key_scale, key_zero, value_scale, value_zero)
        dense = reference.dequantize_int4_pool(*(t[pages] for t in parts))
        return self.paged_decode(query, dense, _with_tables(params, tables))

    def prefill_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch_ref.attention_with_lse``; a whole CPU prompt (queries = keys, no window or
        soft-cap) runs PyTorch's flash kernel with ``is_causal`` instead of a materialised
        ``n x n`` mask: bit-identical, about twice as fast for a 4k-token prompt on 2 cores.
        Chunks keep the masked path (``is_causal`` aligns the diagonal to the top-left)."""
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

    def window_scores(
        self, keys, window_queries, window_lse, scale, logit_softcap=None, reduce="sum"
    ):
        return torch_ref.attention_mass_per_head(
            keys, window_queries, window_lse, scale, logit_softcap=logit_softcap, reduce=reduce
        )

    def window_scores_paged(self, window_queries, kv_pool, tables, num_slots, lse, scale):
        """Per layer ``attention.reference.window_scores_paged``, the window rows' LSE computed from
        the gathered keys where not given."""
        heads = window_queries.shape[0] // tables.shape[0]
        scores, lses = [], []
        for layer in range(tables.shape[0]):
            rows = slice(layer * heads, (layer + 1) * heads)
            queries = window_queries[rows]
            row_lse = None if lse is None else lse[rows].float()
            if row_lse is None:
                row_lse = self._window_lse(queries, kv_pool, tables[layer], num_slots, scale)
            scores.append(
                reference.window_scores_paged(
                    queries, row_lse, kv_pool, tables[layer], num_slots, scale
                )
            )
            lses.append(row_lse)
        return torch.cat(scores), torch.cat(lses)

    @staticmethod
    def _window_lse(queries, kv_pool, table, num_slots, scale) -> torch.Tensor:
        """``[num_heads, w]`` fp32 LSE of the window rows over the slots each one sees."""
        keys, _ = torch_ref.gather_kv(kv_pool, table, num_slots)
        keys = keys.float().repeat_interleave(queries.shape[0] // keys.shape[0], dim=0)
        logits = torch.matmul(queries.float(), keys.transpose(-1, -2)) * scale
        visible = torch_ref.causal_mask(queries.shape[1], num_slots, device=logits.device)
        return torch.logsumexp(logits.masked_fill_(~visible, float("-inf")), dim=-1)

    def write_kv(self, kv_pool, slot_mapping, key, value) -> None:
        torch_ref.write_kv(kv_pool, slot_mapping, key, value)

    def write_kept_slots(self, kv_pool, block_table, key, value, kept) -> None:
        heads = torch.arange(kept.shape[0], device=kept.device)[:, None]
        _write_rows(kv_pool, block_table, key[heads, kept], value[heads, kept])

    def move_slots(self, kv_pool, source, target, kept) -> None:
        num_kv_heads, block_size = kv_pool.shape[2], kv_pool.shape[3]
        heads = torch.arange(num_kv_heads, device=kept.device)[:, None]
        for layer in range(kept.shape[0]):
            # A copy of the source pages: the in-place move never reads a slot it wrote.
            keys, values = torch_ref.gather_kv(kv_pool, source[layer], source.shape[1] * block_size)
            rows = kept[layer]
            _write_rows(kv_pool, target[layer], keys[heads, rows], values[heads, rows])

    def kept_indices(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        return selection.kept_indices_prefer_recent(scores, k)


def _with_tables(params: DecodeParams, tables: torch.Tensor) -> DecodeParams:
    return dataclasses.replace(params, block_tables=tables)


def _write_rows(
    kv_pool: torch.Tensor, block_table: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Rows ``key[:, j]`` / ``value[:, j]`` (``[num_kv_heads, k, head_dim]``) to slot ``j`` of
    the block table, ``j < k``; later slots of the last page untouched."""
    block_size = kv_pool.shape[3]
    slots = torch.arange(key.shape[1], device=kv_pool.device)
    pages = block_table.to(kv_pool.device)[slots // block_size]
    offsets = slots % block_size
    heads = torch.arange(key.shape[0], device=kv_pool.device)[:, None]
    kv_pool[pages[None, :], 0, heads, offsets[None, :]] = key.to(kv_pool.dtype)
    kv_pool[pages[None, :], 1, heads, offsets[None, :]] = value.to(kv_pool.dtype)
