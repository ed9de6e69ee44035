"""Side state: what a request keeps outside its pages, and the pool pages that stand for it.

A budgeted layer keeps its request's recent queries (the observation window, for scoring at
the prefill that compresses and for decode-time eviction); H2O-style methods keep a running
attention mass per held slot; int4 pages keep each layer's not-yet-full page at full
precision. These tensors live outside the page pool but count against
``--kv-cache-memory``: a request that keeps any holds, while it lives, as many pool pages as
its side state needs (``side_pages``), taken with its first step and returned when it ends
(and while it is swapped out: host memory holds the side state then, as it holds the K/V).
A full-cache request with full-precision pages keeps none, so it has the whole pool.

Sizes are upper bounds: queries and masses counted in fp32, the mass over every slot the
request can hold (``num_prompt_tokens + max_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence

from sparsekv.kv_cache.spec import cdiv

FP32_BYTES = 4


def side_state_bytes(
    budgets: Sequence[int | None],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int,
    block_size: int,
    num_int4_layers: int = 0,
    mass_slots: int = 0,
) -> int:
    """Bytes of one request's side state at its largest.

    Args:
        budgets: ``[num_layers]`` the request's layer budgets (``None``: full-cache layer,
            which keeps no window queries).
        num_heads, num_kv_heads, head_dim: the model's query heads, KV heads and head size.
        window: the request's observation window in tokens.
        block_size: slots per page (an int4 layer's full-precision residual is under one
            page of keys and values).
        num_int4_layers: layers whose pages are int4.
        mass_slots: slots whose attention mass each budgeted layer accumulates (``0``: the
            method keeps none).

    Returns:
        Bytes: window queries ``[num_heads, window, head_dim]`` and masses
        ``[num_kv_heads, mass_slots]`` per budgeted layer, residuals
        ``2 x [num_kv_heads, block_size, head_dim]`` per int4 layer, all fp32.
    """
    num_budgeted = sum(budget is not None for budget in budgets)
    per_budgeted = num_heads * window * head_dim + num_kv_heads * mass_slots
    per_int4 = 2 * num_kv_heads * block_size * head_dim
    return FP32_BYTES * (num_budgeted * per_budgeted + num_int4_layers * per_int4)


def side_pages(num_bytes: int, page_bytes: int) -> int:
    """Pool pages that stand for ``num_bytes`` of side state (whole pages, ``0`` for none).

    Raises:
        ValueError: ``page_bytes`` is not positive.
    """
    if page_bytes <= 0:
        raise ValueError(f"page_bytes must be > 0, got {page_bytes}")
    return cdiv(num_bytes, page_bytes)
