"""Multi-query paged attention on CPU: short chunks of new rows (speculative verification,
chunked prefill) over the slots held in the pages, read in place (``csrc/chunk_paged_*``).

The contract is ``AttentionBackend.prefill_attention_paged``'s, for one sequence or a ragged
batch of them: sequence ``b``'s ``m_b`` rows follow its ``num_cached[b]`` held slots (slot
``j`` at page ``block_tables[b, j // block_size]``, offset ``j % block_size``); its row ``i``
sees the held slots and its own keys ``0..i`` (causal, bottom-right aligned), with a sliding
window ``w`` only the ``w`` most recent keys (itself included). GQA reads each KV head once for
its group of query heads. Oracle: ``torch_ref.attention_with_lse`` over the gathered keys.

Variants (:data:`VARIANTS`): ``avx512_amx`` (AMX tiles for items of bf16 pages of up to 32
query rows, group times chunk rows: ``chunk_paged_amx.h``), ``avx512_bf16`` (AVX512-BF16 dot
products over bf16 pages: ``chunk_paged_bf16.h``), ``avx512`` (AVX-512F, 16 lanes), ``avx2``
(AVX2 + FMA, 8 lanes) and ``generic`` (the compiler's baseline, 4 lanes), the last three one
template (``chunk_paged_impl.h``: the item's query rows in vector lanes, keys and values
broadcast against them), which the first two also run for fp32 pages;
``SPARSEKV_KERNEL_ISA`` forces one this CPU runs (tests, comparisons), else the fastest runs.
"""

from __future__ import annotations

import functools

import torch

from sparsekv.attention.cpu import build, ops

VARIANTS = ("avx512_amx", "avx512_bf16", "avx512", "avx2", "generic")
# Longest chunk for which the kernel beats gathering bf16 pages for the flash prefill kernel
# (``ops.prefill_attention``), which packs K / V once and blocks its queries: at 4k held slots
# (9 heads, 3 KV heads, head_dim 64, 1 thread, AMD Zen 4) 0.8 vs 2.6 ms at 5 rows, 2.5 vs 2.8 ms
# at 16, 4.9 vs 3.5 ms at 32. fp32 pages always take the kernel: it is faster up to 128 rows
# (18.5 vs 18.7 ms) and within 7% beyond (512 rows: 65 vs 62 ms, inside this VM's run-to-run
# spread) where the flash kernel takes fp32, and faster at every length where the gather
# feeds PyTorch attention (AVX2: 256 vs 302 ms at 512).
BF16_MAX_ROWS = 16
# The same on AMX tiles (``avx512_amx``, ``csrc/chunk_paged_amx.h``), counted in row blocks (an
# item takes ``32 // group`` chunk rows and reads every key once, where the flash kernel packs
# them once for all rows): at 4000 held slots (9 heads, 3 KV heads: 10-row blocks, head_dim 64,
# 2 threads, Intel Emerald Rapids) 1.46 vs 2.20 ms at 64 rows, 2.61 vs 2.99 ms at 128, 4.76 vs
# 4.20 ms at 256. Groups over 32 run the ``avx512_bf16`` path there.
AMX_MAX_ROW_BLOCKS = 12
_LANES = {"avx512_amx": 16, "avx512_bf16": 16, "avx512": 16, "avx2": 8, "generic": 4}
_DTYPES = (torch.float32, torch.bfloat16)


def chunk_isas() -> tuple[str, ...]:
    """Variants of the chunk kernel this CPU runs, fastest first (empty without the
    extension)."""
    ext = build.load_extension()
    return _chunk_isas(ext) if ext is not None else ()


@functools.cache
def _chunk_isas(ext) -> tuple[str, ...]:
    names = str(ext.chunk_paged_isas())
    return tuple(names.split(",")) if names else ()


def chunk_isa_status(isa: str) -> str:
    """``"ok"`` when this CPU runs variant ``isa``, else why not."""
    ext = build.load_extension()
    return "native kernels unavailable" if ext is None else str(ext.chunk_paged_isa_status(isa))


def chunk_isa(head_dim: int) -> str | None:
    """The variant for ``head_dim`` (a multiple of twice its lanes): the one
    ``SPARSEKV_KERNEL_ISA`` names if this CPU runs it and it fits, else the fastest that fits;
    ``None`` when none does or the extension is unavailable."""
    ext, forced = ops.resolved_setting()  # a step's scope, else read per call: tests set it
    if ext is None:
        return None
    return _pick_chunk_isa(ext, head_dim, forced)


@functools.cache
def _pick_chunk_isa(ext, head_dim: int, forced: str) -> str | None:
    # Cached per setting: every verification layer asks (twice).
    fits = [isa for isa in _chunk_isas(ext) if head_dim % (2 * _LANES[isa]) == 0]
    forced = forced.strip()
    if forced in fits:
        return forced
    return fits[0] if fits else None


def supports_chunk_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    kv_pool: torch.Tensor,
    logit_softcap: float | None = None,
) -> bool:
    """True when :func:`chunk_attention_paged` takes these tensors: CPU fp32 / bf16 query
    ``[num_heads, m, head_dim]`` and pool ``[num_pages, 2, num_kv_heads, block_size, head_dim]``
    (contiguous), chunk keys ``[num_kv_heads, m, head_dim]``, ``num_heads`` a multiple of
    ``num_kv_heads``, no soft-cap, no autograd, and a variant for ``head_dim``."""
    if logit_softcap is not None or query.dim() != 3 or kv_pool.dim() != 5 or key.dim() != 3:
        return False
    if not (query.is_cpu and kv_pool.is_cpu and key.is_cpu):
        return False
    if query.dtype not in _DTYPES or kv_pool.dtype not in _DTYPES or key.dtype not in _DTYPES:
        return False
    num_heads, _, head_dim = query.shape
    num_kv_heads = kv_pool.shape[2]
    if (
        kv_pool.shape[4] != head_dim
        or key.shape[0] != num_kv_heads
        or num_heads % max(num_kv_heads, 1)
        or head_dim > 1024
        or not kv_pool.is_contiguous()
        or query.requires_grad
        or key.requires_grad
    ):
        return False
    return chunk_isa(head_dim) is not None


def bf16_max_rows(head_dim: int, group: int) -> int:
    """Longest chunk over bf16 pages of ``head_dim`` for which the kernel is the faster route,
    with ``group`` query heads per KV head: :data:`AMX_MAX_ROW_BLOCKS` blocks of ``32 // group``
    rows where the ``avx512_amx`` variant runs and takes the group (at most 32), else
    :data:`BF16_MAX_ROWS` rows."""
    if chunk_isa(head_dim) == "avx512_amx" and group <= 32:
        return AMX_MAX_ROW_BLOCKS * (32 // group)
    return BF16_MAX_ROWS


def beats_gather(kv_pool: torch.Tensor, max_rows: int, num_heads: int) -> bool:
    """True when the kernel is the faster route for chunks of up to ``max_rows`` rows of
    ``num_heads`` query heads over ``kv_pool``'s pages ``[num_pages, 2, num_kv_heads,
    block_size, head_dim]``: always for fp32 pages, up to :func:`bf16_max_rows` rows for bf16
    ones."""
    if kv_pool.dtype == torch.float32:
        return True
    group = num_heads // max(kv_pool.shape[2], 1)
    return max_rows <= bf16_max_rows(kv_pool.shape[-1], group)


def chunk_attention_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_pool: torch.Tensor,
    block_table: torch.Tensor,
    num_cached: int,
    scale: float,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk (``AttentionBackend.prefill_attention_paged``).

    Args:
        query: ``[num_heads, m, head_dim]`` fp32 / bf16 (rows may be strided, elements not).
        key, value: ``[num_kv_heads, m, head_dim]`` the chunk's own keys (any float dtype;
            converted to the pool's).
        kv_pool: ``[num_pages, 2, num_kv_heads, block_size, head_dim]`` fp32 / bf16, contiguous.
        block_table: ``[>= ceil(num_cached / block_size)]`` int64 page ids.
        num_cached: held slots before the chunk.
        scale: softmax scale.
        sliding_window: optional window in keys.

    Returns:
        out ``[num_heads, m, head_dim]`` in the query dtype, lse ``[num_heads, m]`` fp32.

    Raises:
        RuntimeError: the extension is unavailable or rejects the tensors (see
            :func:`supports_chunk_paged`).
    """
    counts = torch.tensor([0, query.shape[1], num_cached], dtype=torch.int64)  # one tensor
    tables = block_table.to(torch.int64).reshape(1, -1)
    starts, cached = counts[:2], counts[2:]
    return chunk_attention_paged_batch(
        query, key, value, kv_pool, tables, starts, cached, scale, sliding_window
    )


def chunk_attention_paged_batch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    row_starts: torch.Tensor,
    num_cached: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    isa: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several sequences' chunks in one call (a ragged batch, rows concatenated).

    Args:
        query: ``[num_heads, rows, head_dim]``, sequence ``b``'s rows at
            ``row_starts[b]:row_starts[b + 1]``.
        key, value: ``[num_kv_heads, rows, head_dim]`` the chunks' own keys and values.
        kv_pool: as :func:`chunk_attention_paged`.
        block_tables: ``[batch, max_blocks]`` int64 page ids (padding entries unread).
        row_starts: ``[batch + 1]`` int64, from 0 to ``rows``.
        num_cached: ``[batch]`` int64 held slots of each sequence.
        scale, sliding_window: as :func:`chunk_attention_paged`.
        isa: the variant to run (benchmarks), or ``None`` for :func:`chunk_isa`'s choice.

    Returns:
        out ``[num_heads, rows, head_dim]`` in the query dtype, lse ``[num_heads, rows]`` fp32.

    Raises:
        RuntimeError: no variant for these tensors, or the kernel rejects them (page ids out
            of range, inconsistent shapes, an ``isa`` this CPU does not run).
    """
    ext, forced = ops.resolved_setting()
    if ext is not None and isa is None:
        isa = _pick_chunk_isa(ext, query.shape[-1], forced)
    if ext is None or isa is None:
        raise RuntimeError("no native chunk attention kernel for these tensors")
    query = query if query.stride(-1) == 1 else query.contiguous()
    key, value = (t.to(kv_pool.dtype) for t in (key, value))
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    window = int(sliding_window) if sliding_window else 0
    out, lse = ext.chunk_paged_attention(
        query,
        key,
        value,
        kv_pool,
        block_tables.to(torch.int64).contiguous(),
        row_starts.to(torch.int64).contiguous(),
        num_cached.to(torch.int64).contiguous(),
        float(scale),
        window,
        isa,
    )
    return out, lse
