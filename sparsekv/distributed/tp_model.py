"""Shard a loaded decoder over tensor-parallel ranks (Megatron-LM's layout, as vLLM runs it).

Per layer (``tp_layout.RankShard`` says which rows each rank keeps):

- ``qkv_proj`` is column-parallel: the rank keeps the rows of its query heads, of its KV heads'
  keys and of their values (q, k and v sliced by head separately, then fused again);
- ``o_proj`` is row-parallel: the columns of its query heads; the partial outputs are summed by
  an all-reduce (the bias is added once, by rank 0);
- ``gate_up_proj`` keeps its chunk of the gate rows and the same chunk of the up rows (the two
  halves sliced separately), ``down_proj`` the matching columns, then an all-reduce;
- the embedding is vocabulary-parallel: each rank looks up the ids in its rows, zeros the
  others, and an all-reduce sums the one non-zero row per token; the output head keeps the same
  rows and its logits are all-gathered (padded to the largest rank's rows), so every rank holds
  the full fp32 logits the soft-cap and the sampler read.

Norms and rotary tables are replicated. After sharding, ``model.num_heads`` and
``model.num_kv_heads`` are the rank's own counts: its page pool and side state are sized by
them. Each rank loads the whole checkpoint and keeps its slices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from sparsekv.distributed.tp_layout import RankShard, split_evenly


class VocabParallelEmbedding(nn.Module):
    """The embedding rows ``[start, start + count)`` of one rank; the rows of a step are
    summed over the group.

    Args:
        weight: ``[count, hidden]`` this rank's rows.
        start: first vocabulary id it holds.
        group: the tensor-parallel process group (``None``: the default group).
    """

    def __init__(self, weight: torch.Tensor, start: int, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` int64 ids -> ``[T, hidden]`` embeddings (identical on every rank)."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows.masked_fill_(outside[:, None], 0)
        dist.all_reduce(rows, group=self.group)
        return rows


def _rows(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The rows ``[start, start + count)`` of every range, concatenated (a new tensor)."""
    return torch.cat([tensor[start : start + count] for start, count in ranges]).clone()


def _new_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, keep_bias: bool = True
) -> nn.Linear:
    new = nn.Linear(
        weight.shape[1],
        weight.shape[0],
        bias=bias is not None and keep_bias,
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        new.weight.copy_(weight)
        if new.bias is not None:
            new.bias.copy_(bias)
    return new.requires_grad_(False)


def _all_reduce_output(group):
    def hook(module, inputs, output):
        dist.all_reduce(output, group=group)
        return output

    return hook


def _gather_logits(shard: RankShard, group):
    """Forward hook of the output head: ``[rows, vocab_count]`` -> ``[rows, vocab]``."""

    def hook(module, inputs, output):
        pad = shard.vocab_chunk - output.shape[-1]
        if pad:
            output = F.pad(output, (0, pad))
        parts = [torch.empty_like(output) for _ in range(shard.world_size)]
        dist.all_gather(parts, output.contiguous(), group=group)
        counts = [split_evenly(shard.vocab_size, shard.world_size, r)[1] for r in range(len(parts))]
        return torch.cat([part[..., :count] for part, count in zip(parts, counts)], dim=-1)

    return hook


def shard_model(model: nn.Module, shard: RankShard, group=None) -> nn.Module:
    """Slice a loaded ``DecoderForCausalLM`` to ``shard`` in place and add its collectives.

    Args:
        model: the full model, weights loaded (before any weight quantization or prepacking).
        shard: this rank's slice (``tp_layout.rank_shard`` of the model's shape).
        group: the tensor-parallel process group (``None``: the default group).

    Returns:
        ``model``, whose ``num_heads`` / ``num_kv_heads`` are now the rank's.
    """
    d = model.head_dim
    num_heads, num_kv_heads = model.num_heads, model.num_kv_heads
    q_rows = (shard.q_start * d, shard.q_count * d)
    k_rows = ((num_heads + shard.kv_start) * d, shard.kv_count * d)
    v_rows = ((num_heads + num_kv_heads + shard.kv_start) * d, shard.kv_count * d)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        bias = None if qkv.bias is None else _rows(qkv.bias, [q_rows, k_rows, v_rows])
        attn.qkv_proj = _new_linear(_rows(qkv.weight, [q_rows, k_rows, v_rows]), bias)
        o = attn.o_proj
        o_weight = o.weight[:, q_rows[0] : q_rows[0] + q_rows[1]].clone()
        attn.o_proj = _new_linear(o_weight, o.bias, keep_bias=shard.rank == 0)
        attn.o_proj.register_forward_hook(_all_reduce_output(group))
        attn.num_heads, attn.num_kv_heads = shard.q_count, shard.kv_count
        attn.q_size = shard.q_count * d
        attn.head_counts = (shard.q_count, shard.kv_count, shard.kv_count)
        inter = mlp.gate_up_proj.weight.shape[0] // 2
        gate = (shard.mlp_start, shard.mlp_count)
        up = (inter + shard.mlp_start, shard.mlp_count)
        gu = mlp.gate_up_proj
        bias = None if gu.bias is None else _rows(gu.bias, [gate, up])
        mlp.gate_up_proj = _new_linear(_rows(gu.weight, [gate, up]), bias)
        down = mlp.down_proj
        down_weight = down.weight[:, shard.mlp_start : shard.mlp_start + shard.mlp_count].clone()
        mlp.down_proj = _new_linear(down_weight, down.bias, keep_bias=shard.rank == 0)
        mlp.down_proj.register_forward_hook(_all_reduce_output(group))
    vocab = (shard.vocab_start, shard.vocab_count)
    tied = model.lm_head.weight is model.embed_tokens.weight
    embed = VocabParallelEmbedding(_rows(model.embed_tokens.weight, [vocab]), shard.vocab_start)
    embed.group = group
    model.embed_tokens = embed
    if tied:
        head = nn.Linear(model.variant.hidden_size, shard.vocab_count, bias=False)
        head.weight = embed.weight
    else:
        head = _new_linear(_rows(model.lm_head.weight, [vocab]), None)
    head.register_forward_hook(_gather_logits(shard, group))
    model.lm_head = head
    model.num_heads, model.num_kv_heads = shard.q_count, shard.kv_count
    model.tp_shard = shard
    return model
