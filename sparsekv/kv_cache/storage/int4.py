"""KIVI int4 pages: keys per channel, values per token, the partial last page at full precision
(``LayerKV.residual``)."""

from __future__ import annotations

from dataclasses import replace

import torch

from sparsekv.attention.backends import DecodeParams, DecodeResult
from sparsekv.attention.paging import gather_kv
from sparsekv.kv_cache import quant
from sparsekv.kv_cache.request_kv import LayerKV
from sparsekv.kv_cache.storage.base import KVStorage, materialize


class Int4Storage(KVStorage):
    """KIVI int4 pages: keys per channel (per page and head), values per token; full pages
    only, the partial last page's slots stay in ``LayerKV.residual`` at full precision."""

    kv_cache_dtype = "int4"

    def _allocate(self) -> list[torch.Tensor]:
        n, h, bs, d = self.num_pages, self.num_kv_heads, self.block_size, self.head_dim
        if d % 2:
            raise ValueError(f"kv_cache_dtype int4 needs an even head_dim, got {d}")
        pages = self.backend.allocate_pages
        return [
            pages((n, 2, h, bs, d // 2), torch.uint8, self.device),
            pages((n, h, d), torch.float16, self.device),  # key scale
            pages((n, h, d), torch.float16, self.device),  # key zero
            pages((n, h, bs), torch.float16, self.device),  # value scale
            pages((n, h, bs), torch.float16, self.device),  # value zero
        ]

    def _store_pages(self, index: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Quantize full pages: key, value ``[num_kv_heads, len(index) * block_size, d]``."""
        h, bs, d = self.num_kv_heads, self.block_size, self.head_dim
        key = key.reshape(h, -1, bs, d).transpose(0, 1)  # [p, h, bs, d]
        value = value.reshape(h, -1, bs, d).transpose(0, 1)
        key_codes, key_scale, key_zero = quant.quantize_int4_keys(key)
        value_codes, value_scale, value_zero = quant.quantize_int4_values(value)
        codes = torch.stack((key_codes, value_codes), dim=1)
        for tensor, part in zip(
            self.tensors, (codes, key_scale, key_zero, value_scale, value_zero)
        ):
            tensor.index_copy_(0, index, part)

    def dequantize_pages(self, index: torch.Tensor) -> torch.Tensor:
        codes, key_scale, key_zero, value_scale, value_zero = (
            t.index_select(0, index) for t in self.tensors
        )
        keys = quant.dequantize_int4_keys(codes[:, 0], key_scale, key_zero, self.dtype)
        values = quant.dequantize_int4_values(codes[:, 1], value_scale, value_zero, self.dtype)
        return torch.stack((keys, values), dim=1)

    def write_decode(self, slot_mapping, states, key, value) -> None:
        for i, state in enumerate(states):
            self.write_slots(
                state, state.block_table, state.num_held, key[i, :, None], value[i, :, None]
            )

    def write_slots(self, state, table, start, key, value) -> None:
        bs = self.block_size
        residual = state.residual
        num_residual = 0 if residual is None else residual[0].shape[1]
        if num_residual != start % bs:
            raise AssertionError(f"int4 residual holds {num_residual} slots, expected {start % bs}")
        key, value = key.to(self.dtype), value.to(self.dtype)
        if residual is not None:
            key = torch.cat((residual[0], key), dim=1)
            value = torch.cat((residual[1], value), dim=1)
        first_page = start // bs
        num_full = key.shape[1] // bs
        if num_full:
            index = self.local(table[first_page : first_page + num_full])
            self._store_pages(index, key[:, : num_full * bs], value[:, : num_full * bs])
        rest = key.shape[1] - num_full * bs
        state.residual = None
        if rest:
            state.residual = (key[:, -rest:].contiguous(), value[:, -rest:].contiguous())

    def write_leading(self, state, table, key, value) -> None:
        state.residual = None
        self.write_slots(state, table, 0, key, value)

    def gather(self, state, table, num_held):
        num_full = num_held // self.block_size
        dense = self.dequantize_pages(self.local(table[:num_full]))
        keys, values = gather_kv(dense, torch.arange(num_full), num_full * self.block_size)
        if num_held > num_full * self.block_size:
            keys = torch.cat((keys, state.residual[0]), dim=1)
            values = torch.cat((values, state.residual[1]), dim=1)
        return keys, values

    def decode_attention(
        self, query: torch.Tensor, params: DecodeParams, states: list[LayerKV]
    ) -> DecodeResult:
        """Where the backend reads int4 pages in place (``supports_int4_decode``), it attends
        the full pages, and each request's residual (its newest ``< block_size`` slots, the
        new token included) is attended in one padded batch here; the two parts merge through
        their log-sum-exps. Sliding windows and attention mass (per-head renormalisation) take
        the dequantizing path."""
        params = _with_first_slots(self._local_params(params))
        if (
            params.sliding_window is not None
            or params.return_attn_mass
            or not self.backend.supports_int4_decode(query, *self.tensors)
        ):
            return self._decode_dequantized(query, params, states)
        seq_lens, first_slots = params.seq_lens, params.first_slots
        num_residual = (seq_lens - first_slots) % self.block_size
        pages = replace(params, seq_lens=seq_lens - num_residual, sliding_window=None)
        out, lse, _ = self.backend.paged_decode_int4(query, *self.tensors, pages)
        if not bool(num_residual.any()):
            return out, lse, None
        out, lse = self._merge_residuals(
            query, states, num_residual, out, lse, params.scale, params.logit_softcap
        )
        return out, lse, None

    def _merge_residuals(self, query, states, num_residual, out, lse, scale, logit_softcap):
        """Attention over the residual slots (padded to ``block_size``) merged with the
        kernel's part: ``lse = logaddexp(lse_pages, lse_residual)`` and each part's output
        weighted by ``exp(its lse - lse)``."""
        batch, num_heads, head_dim = query.shape
        num_kv_heads, block = self.num_kv_heads, self.block_size
        group = num_heads // num_kv_heads
        keys = query.new_zeros((batch, num_kv_heads, block, head_dim), dtype=torch.float32)
        values = torch.zeros_like(keys)
        for i, state in enumerate(states):
            if state.residual is not None:
                count = state.residual[0].shape[1]
                keys[i, :, :count] = state.residual[0]
                values[i, :, :count] = state.residual[1]
        q = query.float().view(batch, num_kv_heads, group, head_dim)
        logits = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [b, kvh, g, block]
        if logit_softcap is not None:
            logits = torch.tanh(logits / logit_softcap) * logit_softcap
        held = torch.arange(block, device=query.device)[None, :] < num_residual[:, None]
        logits.masked_fill_(~held[:, None, None, :], float("-inf"))
        residual_lse = torch.logsumexp(logits, dim=-1)  # -inf for requests without residual
        probs = torch.exp(logits - residual_lse.clamp_min(-1e30)[..., None])
        residual_out = torch.matmul(probs, values)
        page_lse = lse.view(batch, num_kv_heads, group)
        total = torch.logaddexp(page_lse, residual_lse)
        page_out = out.float().view(batch, num_kv_heads, group, head_dim)
        # A request whose slots all sit in its residual has no page part (lse -inf).
        page_out = torch.where(torch.isfinite(page_lse)[..., None], page_out, 0.0)
        merged = (
            page_out * torch.exp(page_lse - total)[..., None]
            + residual_out * torch.exp(residual_lse - total)[..., None]
        )
        return merged.reshape(batch, num_heads, head_dim).to(query.dtype), total.view(
            batch, num_heads
        )

    def _decode_dequantized(
        self, query: torch.Tensor, params: DecodeParams, states: list[LayerKV]
    ) -> DecodeResult:
        """Dequantize every referenced page once, overlay the residuals, decode densely."""
        params = _with_first_slots(params)
        dense, remapped = materialize(self.dequantize_pages, params.block_tables)
        held_now = (params.seq_lens - params.first_slots).tolist()  # the new token included
        for i, state in enumerate(states):
            if state.residual is not None:
                num = state.residual[0].shape[1]
                page = remapped[i, held_now[i] // self.block_size]
                dense[page, 0, :, :num] = state.residual[0]
                dense[page, 1, :, :num] = state.residual[1]
        return self.backend.paged_decode(query, dense, replace(params, block_tables=remapped))


def _with_first_slots(params: DecodeParams) -> DecodeParams:
    """``params`` with explicit first slots (0 where not given): the residual count needs them."""
    if params.first_slots is not None:
        return params
    return replace(params, first_slots=torch.zeros_like(params.seq_lens))
