"""Which heads, MLP columns and vocabulary rows each tensor-parallel rank holds.

Ranks hold whole GQA groups (a KV head and every query head that reads it), so attention and
per-KV-head compression scoring never need another rank's queries. With at least as many KV
heads as ranks the groups are dealt out in order, the first ranks taking one more where they do
not divide (6 query / 3 KV heads on 2 ranks: 4 + 2 query heads, 2 + 1 KV heads). With fewer KV
heads than ranks each KV head is replicated on ``ranks / kv_heads`` ranks that split its group's
query heads (vLLM's rule); those ranks reduce the group's scores between them
(``tp_compression``). The MLP's intermediate columns and the vocabulary are split in contiguous
chunks the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankShard:
    """One rank's slice of the model.

    Attributes:
        rank, world_size: this rank and the group size.
        num_heads, num_kv_heads: the model's query and KV heads (all ranks).
        q_start, q_count: query heads ``[q_start, q_start + q_count)``.
        kv_start, kv_count: KV heads ``[kv_start, kv_start + kv_count)``.
        replicas: ranks holding this rank's KV head (1 unless KV heads are replicated).
        replica_ranks: those ranks, ascending (this one included).
        mlp_start, mlp_count: intermediate columns of the MLP.
        vocab_start, vocab_count: vocabulary rows of the embedding and the output head.
        vocab_size: the model's vocabulary.
        vocab_chunk: the largest rank's vocabulary rows (gathered logits are padded to it).
    """

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int
    replicas: int
    replica_ranks: tuple[int, ...]
    mlp_start: int
    mlp_count: int
    vocab_start: int
    vocab_count: int
    vocab_size: int
    vocab_chunk: int

    @property
    def replicated(self) -> bool:
        """KV heads are shared with other ranks (fewer KV heads than ranks)."""
        return self.replicas > 1


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, count)`` of chunk ``index`` when ``total`` items go to ``parts`` chunks in
    order, the first ``total % parts`` chunks one larger."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (index < extra)


def rank_shard(
    rank: int,
    world_size: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    vocab_size: int,
) -> RankShard:
    """The slice of a decoder that ``rank`` of ``world_size`` holds.

    Raises:
        ValueError: (``tensor_parallel_size``) more ranks than query heads, more ranks than
            KV heads without dividing evenly, a KV group whose query heads do not split over
            its replicas, or fewer MLP columns / vocabulary rows than ranks.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is outside [0, {world_size})")
    if num_heads % num_kv_heads:
        raise ValueError(f"model: {num_heads} query heads over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if world_size > min(num_heads, intermediate_size, vocab_size):
        raise ValueError(
            f"tensor_parallel_size: {world_size} ranks but the model has {num_heads} query "
            f"heads, {intermediate_size} MLP columns and {vocab_size} tokens (each rank needs "
            "at least one of each)"
        )
    if num_kv_heads >= world_size:
        kv_start, kv_count = split_evenly(num_kv_heads, world_size, rank)
        q_start, q_count = kv_start * group, kv_count * group
        replicas, replica_ranks = 1, (rank,)
    else:
        if world_size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size: {world_size} ranks over {num_kv_heads} KV heads: with "
                "fewer KV heads than ranks the ranks must be a multiple of the KV heads"
            )
        replicas = world_size // num_kv_heads
        if group % replicas:
            raise ValueError(
                f"tensor_parallel_size: a KV head's {group} query heads do not split over its "
                f"{replicas} replicas"
            )
        kv_start, kv_count = rank // replicas, 1
        per_rank = group // replicas
        q_start, q_count = kv_start * group + (rank % replicas) * per_rank, per_rank
        first = kv_start * replicas
        replica_ranks = tuple(range(first, first + replicas))
    mlp_start, mlp_count = split_evenly(intermediate_size, world_size, rank)
    vocab_start, vocab_count = split_evenly(vocab_size, world_size, rank)
    return RankShard(
        rank=rank,
        world_size=world_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        q_start=q_start,
        q_count=q_count,
        kv_start=kv_start,
        kv_count=kv_count,
        replicas=replicas,
        replica_ranks=replica_ranks,
        mlp_start=mlp_start,
        mlp_count=mlp_count,
        vocab_start=vocab_start,
        vocab_count=vocab_count,
        vocab_size=vocab_size,
        vocab_chunk=split_evenly(vocab_size, world_size, 0)[1],
    )


def replica_groups(num_kv_heads: int, world_size: int) -> list[tuple[int, ...]]:
    """The rank sets sharing one KV head (empty when no KV head is replicated)."""
    if num_kv_heads >= world_size:
        return []
    replicas = world_size // num_kv_heads
    return [tuple(range(k * replicas, (k + 1) * replicas)) for k in range(num_kv_heads)]
