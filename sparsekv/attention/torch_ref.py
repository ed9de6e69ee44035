"""Plain-PyTorch attention over the paged KV layout: the CPU path and the oracle of every kernel.

Page layout (docs/design.md, "KV memory"): one pool tensor ``[num_pages, 2 (K, V), num_kv_heads, block_size,
head_dim]``; a (request, layer) owns a block table of page ids, and its logical slot ``s`` lives
in page ``block_table[(s - first_slot) // block_size]`` at offset ``s % block_size``
(``first_slot`` is a multiple of ``block_size``; sliding layers free leading pages this way).

Masks come from the physical cache: a query sees every held slot up to its own (causal by slot
count), optionally limited to a sliding window of slots. Each function returns the log-sum-exp
of every query row (natural log, fp32), which compression scoring reuses (window scores need one extra pass over the window rows only).
"""

from __future__ import annotations

import torch

from sparsekv.attention.paging import gather_kv, write_kv, write_leading_slots

__all__ = [
    "attention_mass_per_head",
    "attention_with_lse",
    "causal_mask",
    "gather_kv",
    "paged_decode_attention",
    "write_kv",
    "write_leading_slots",
]

# Logit elements per chunk of ``attention_mass_per_head`` (64 MiB of fp32): bounds memory for
# long prompts.
MAX_CHUNK_ELEMENTS = 1 << 24


def causal_mask(
    num_queries: int,
    num_keys: int,
    sliding_window: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Boolean visibility ``[num_queries, num_keys]`` for queries that are the last keys.

    Query ``i`` sits at key index ``num_keys - num_queries + i`` and sees keys up to it; with a
    sliding window ``w`` it sees only the ``w`` most recent of those (itself included).
    """
    q_index = torch.arange(num_queries, device=device)[:, None] + (num_keys - num_queries)
    k_index = torch.arange(num_keys, device=device)[None, :]
    visible = k_index <= q_index
    if sliding_window is not None:
        visible &= k_index > q_index - sliding_window
    return visible


def attention_with_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the last ``num_queries`` tokens over ``num_keys`` keys, with LSE.

    Args:
        query: ``[num_heads, num_queries, head_dim]``.
        key, value: ``[num_kv_heads, num_keys, head_dim]``, ``num_keys >= num_queries``;
            ``num_heads`` is a multiple of ``num_kv_heads`` (GQA).
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: optional window in slots (Gemma 3 local layers).
        logit_softcap: optional tanh soft-cap of attention logits.

    Returns:
        out: ``[num_heads, num_queries, head_dim]`` in the query dtype.
        lse: ``[num_heads, num_queries]`` fp32 natural-log sum of exp(q.k * scale).
    """
    num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_keys, _ = key.shape
    if num_queries == 0 or num_heads == 0:  # PyTorch's CPU flash op divides by zero here
        out = query.new_empty((num_heads, num_queries, value.shape[-1]))
        return out, query.new_empty((num_heads, num_queries), dtype=torch.float32)
    group = num_heads // num_kv_heads
    if group > 1:
        key = key.repeat_interleave(group, dim=0)
        value = value.repeat_interleave(group, dim=0)
    key = key.to(query.dtype)
    value = value.to(query.dtype)
    visible = causal_mask(num_queries, num_keys, sliding_window, query.device)
    if (
        logit_softcap is None
        and query.dtype in (torch.float32, torch.bfloat16)
        and query.device.type == "cpu"  # the op is PyTorch's CPU flash kernel
    ):
        bias = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
        bias.masked_fill_(~visible, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query[None], key[None], value[None], attn_mask=bias, scale=scale
        )[:2]
        return out[0], lse[0].float()
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    scores.masked_fill_(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs, value.float()).to(query.dtype)
    return out, lse


def paged_decode_attention(
    query: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    first_slots: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    return_attn_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One query token per request attending over its paged K/V (gather + dense math).

    Args:
        query: ``[batch, num_heads, head_dim]`` (the new token's K/V is already in the pool).
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]``.
        block_tables: ``[batch, max_blocks]`` int64 page ids (padding entries may be any valid
            page id; they are masked).
        seq_lens: ``[batch]`` int64 logical slot count ``num_slots`` (new token included).
        scale: softmax scale.
        first_slots: ``[batch]`` int64 logical slot of each first held page (default 0).
        sliding_window: see ``attention_with_lse``.
        logit_softcap: see ``attention_with_lse``.
        return_attn_mass: also return each held slot's attention probability, summed over the
            query heads of its KV group (H2O accumulates it).

    Returns:
        out: ``[batch, num_heads, head_dim]``; lse: ``[batch, num_heads]`` fp32;
        mass: ``[batch, num_kv_heads, max_blocks * block_size]`` fp32 over held slots (zero past
        each request's held count), or ``None``. A row that sees no slot (a padding row:
        ``seq_lens == first_slots``) gets a zero output, lse ``-inf`` and zero mass.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_pool.shape[2], kv_pool.shape[3]
    group = num_heads // num_kv_heads
    if batch == 0:
        empty_lse = query.new_empty((0, num_heads), dtype=torch.float32)
        mass = query.new_empty((0, num_kv_heads, 0), dtype=torch.float32)
        return query.clone(), empty_lse, mass if return_attn_mass else None
    if first_slots is None:
        first_slots = torch.zeros_like(seq_lens)
    max_blocks = block_tables.shape[1]
    pages = kv_pool[block_tables]  # [b, nb, 2, kvh, bs, d]
    kv = pages.permute(2, 0, 3, 1, 4, 5).reshape(
        2, batch, num_kv_heads, max_blocks * block_size, -1
    )
    keys, values = kv[0].float(), kv[1].float()
    q = query.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [b, kvh, g, L]
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    held = (seq_lens - first_slots)[:, None]
    slot = torch.arange(max_blocks * block_size, device=query.device)[None, :]
    visible = slot < held
    if sliding_window is not None:
        logical = slot + first_slots[:, None]
        visible &= logical > (seq_lens[:, None] - 1 - sliding_window)
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, kvh, g]
    probs = torch.exp(scores - lse[..., None])
    probs.masked_fill_(~visible.any(dim=-1)[:, None, None, None], 0.0)  # padding rows: not NaN
    out = torch.matmul(probs, values).reshape(batch, num_heads, head_dim).to(query.dtype)
    mass = probs.sum(dim=2) if return_attn_mass else None
    return out, lse.reshape(batch, num_heads), mass


def attention_mass_per_head(
    keys: torch.Tensor,
    queries: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    max_chunk_elements: int = MAX_CHUNK_ELEMENTS,
    logit_softcap: float | None = None,
    reduce: str = "sum",
) -> torch.Tensor:
    """Sum (or max) over query rows of the causal softmax weights on each slot, per query head.

    Works chunk-wise over query rows; a chunk only touches the slots its rows can see.

    Args:
        keys: ``[num_kv_heads, n, head_dim]`` held keys (post-RoPE), any float dtype.
        queries: ``[num_heads, q, head_dim]`` queries of the last ``q <= n`` tokens;
            ``num_heads`` is a multiple of ``num_kv_heads`` (GQA, query head ``h`` reads KV head
            ``h // group``).
        lse: ``[num_heads, q]`` natural-log softmax denominator of each row over the slots it
            sees, as returned by the attention; ``None`` computes it here.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        max_chunk_elements: most logit elements materialised at once.
        logit_softcap: the model's attention soft-cap: logits are ``cap * tanh(x / cap)`` of
            the scaled products (Gemma 2), as the attention computed them; ``None``: none.
        reduce: ``sum`` over the rows (SnapKV, H2O) or ``max`` (KVzip).

    Returns:
        ``[num_heads, n]`` fp32: ``sum_i exp(l_ij - lse_i)`` (or ``max_i``) over visible
        ``(i, j)``, with ``l_ij = q_i.k_j * scale`` (soft-capped when ``logit_softcap`` is
        set); a slot no row sees scores 0.

    Raises:
        ValueError: ``reduce`` is neither ``sum`` nor ``max``.
    """
    if reduce not in ("sum", "max"):
        raise ValueError(f"reduce: expected 'sum' or 'max', got {reduce!r}")
    num_kv_heads, n, head_dim = keys.shape
    num_heads, q, _ = queries.shape
    assert num_heads % num_kv_heads == 0 and q <= n, (keys.shape, queries.shape)
    group = num_heads // num_kv_heads
    keys32 = keys.float()
    queries32 = queries.float().reshape(num_kv_heads, group, q, head_dim)
    lse32 = None if lse is None else lse.float().reshape(num_kv_heads, group, q)
    mass = torch.zeros(num_kv_heads, group, n, dtype=torch.float32, device=keys.device)
    rows = max(1, max_chunk_elements // max(1, num_heads * n))
    for start in range(0, q, rows):
        end = min(q, start + rows)
        num_visible = n - q + end  # the chunk's last row sees slots [0, num_visible)
        # [num_kv_heads, group, end - start, num_visible]; a group's query rows are folded
        # into one matrix per KV head (one bmm, no broadcast copy of the keys: ~3x faster).
        chunk = queries32[:, :, start:end].reshape(num_kv_heads, group * (end - start), head_dim)
        logits = torch.bmm(chunk, keys32[:, :num_visible].transpose(-1, -2))
        logits = logits.view(num_kv_heads, group, end - start, num_visible) * scale
        if logit_softcap is not None:
            logits = torch.tanh(logits / logit_softcap) * logit_softcap
        visible = causal_mask(end - start, num_visible, device=keys.device)
        logits.masked_fill_(~visible, float("-inf"))
        if lse32 is None:
            row_lse = torch.logsumexp(logits, dim=-1)
        else:
            row_lse = lse32[:, :, start:end]
        probs = torch.exp(logits - row_lse[..., None])
        if reduce == "max":
            seen = mass[:, :, :num_visible]
            torch.maximum(seen, probs.amax(dim=2), out=seen)
        else:
            mass[:, :, :num_visible] += probs.sum(dim=2)
    return mass.reshape(num_heads, n)
