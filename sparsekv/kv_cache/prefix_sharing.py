"""Where requests' block tables meet the prefix cache: attach a hit, offer computed pages.

A page of tokens may enter the cache only if every layer holds it uncompressed at its logical
slots: K/V computed after any eviction depend on what was evicted, so they are never shared.
These helpers work on one request's ``LayerKV`` list; ``KVCacheManager`` calls them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from sparsekv.kv_cache.block_pool import BlockPool
from sparsekv.kv_cache.plan import LayerPlan, LayerStep
from sparsekv.kv_cache.prefix_cache import PrefixCache
from sparsekv.kv_cache.request_kv import LayerKV, RequestKV


def attach_hit(
    cache: PrefixCache,
    pool: BlockPool,
    layers: list[LayerKV],
    token_ids: Sequence[int],
    max_tokens: int,
) -> int:
    """Give an empty request the longest cached prefix of ``token_ids`` (page-aligned, at most
    ``max_tokens`` tokens): each layer's table gets the hit pages (one reference each) and
    ``num_slots`` = the hit.

    Returns:
        Tokens hit (0 on a miss).
    """
    assert all(not state.block_table for state in layers), "attach to a non-empty request"
    digests = cache.match(token_ids, max_tokens)
    if not digests:
        return 0
    num_hit = len(digests) * cache.block_size
    for layer, state in enumerate(layers):
        pages = cache.pages_of(digests, layer)
        pool.incref(pages)
        state.block_table = pages
        state.num_slots = num_hit
    return num_hit


def offer_computed(cache: PrefixCache, layers: list[LayerKV], token_ids: Sequence[int]) -> None:
    """Cache the full pages of ``token_ids`` a request holds, if no layer ever evicted.

    Args:
        cache: the prefix cache.
        layers: the request's layers (tables hold logical slots ``0..num_held-1``).
        token_ids: the request's tokens whose K/V were computed (or a prefix of them).
    """
    if any(s.num_evicted or s.first_slot or s.compact_table for s in layers):
        return
    num = min([len(token_ids)] + [s.num_held for s in layers])
    cache.insert(token_ids[:num], [s.block_table for s in layers])


def offer_step(
    cache: PrefixCache, layers: list[LayerKV], steps: list[LayerStep], token_ids: Sequence[int]
) -> None:
    """Cache the full pages of ``token_ids`` after a step (before it commits) if every layer's
    ``block_table`` holds them uncompressed: no eviction before the step, and a compacting
    layer kept its uncompressed K/V (``LayerStep.keep_uncompressed``)."""
    for state, step in zip(layers, steps):
        if state.num_evicted or state.first_slot:
            return
        if step.compress_to is not None and not step.keep_uncompressed:
            return
    num = min([len(token_ids)] + [step.num_held + step.num_new for step in steps])
    cache.insert(token_ids[:num], [step.block_table for step in steps])


def may_keep_uncompressed(
    pool: BlockPool,
    kv: RequestKV,
    plans: list[LayerPlan],
    num_new: int,
    block_size: int,
) -> bool:
    """Whether a compressing last prefill chunk could keep its uncompressed prompt for the
    cache: some layer compacts, no layer evicted before, and the prompt has full pages the
    cache does not hold yet (the caller checks the step flags, policy and option)."""
    if all(plan.compress_to is None for plan in plans):
        return False
    if any(s.num_evicted or s.first_slot for s in kv.layers):
        return False
    first = kv.layers[0]
    num_cached = sum(1 for page in first.block_table if pool.is_cached(page))
    return (first.num_held + num_new) // block_size > num_cached


def table_holders(requests: Iterable[RequestKV]) -> Counter[int]:
    """Page -> number of block tables (compaction tables in flight included) holding it."""
    holders: Counter[int] = Counter()
    for kv in requests:
        for state in kv.layers:
            holders.update(state.block_table)
            holders.update(state.compact_table or [])
    return holders
