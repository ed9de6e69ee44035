"""An independent dense reference of layer-wise KV compression (test oracle).

It keeps every token's K/V and query, and per (layer, KV head) a boolean *kept* mask over token
positions. Attention is plain softmax over the visible kept positions; compression events are
decided by the same counters as the engine's budget rules (compress at the end of the
prompt when it exceeds the budget; at decode when a layer holds ``budget + block_size``) and
choose tokens by brute force: the full softmax matrix of the window queries, pooled, GQA-averaged,
top-k with ties to the more recent token. No paging, no LSE reuse, no gathering: a different
implementation of the same algorithm, against which the engine's logits are compared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsekv.config import CompressionConfig


class DenseMaskedAttention:
    """Attention context for ``model.forward`` of ONE request, run one step at a time.

    Args:
        num_layers: model layers.
        budgets: per layer budget or ``None`` (full).
        window: observation window.
        block_size: decode-time eviction slack (compress at ``budget + block_size``).
        num_prompt_tokens: prompt length (compression at the end of the prompt).
        kernel_size, pooling: SnapKV score smoothing.
        logit_softcap: the model's attention soft-cap (``cap * tanh(x / cap)`` of the scaled
            logits, in attention and in the scores), or ``None``.
        head_budgets: ``adaptive``: the KV heads share ``num_kv_heads * budget`` slots at the
            end of the prompt (Ada-KV with a 0.2 safeguard, ranked by a Python sort over
            (score, slot, head)), no decode-time eviction; ``flat``: ``budget`` per head.
    """

    def __init__(
        self,
        num_layers,
        budgets,
        window,
        block_size,
        num_prompt_tokens,
        kernel_size=CompressionConfig().kernel_size,
        pooling="max",
        logit_softcap=None,
        head_budgets="flat",
    ):
        self.head_budgets = head_budgets
        self.budgets = budgets
        self.window = window
        self.block_size = block_size
        self.num_prompt = num_prompt_tokens
        self.kernel_size = kernel_size
        self.pooling = pooling
        self.softcap = logit_softcap
        self.keys = [None] * num_layers  # [KVH, T, d]
        self.values = [None] * num_layers
        self.queries = [None] * num_layers  # [H, T, d]
        self.kept = [None] * num_layers  # [KVH, T] bool

    def attend(self, layer, q, k, v, scale, sliding_window=None):
        q, k, v = q.double(), k.double(), v.double()
        new_q, new_k, new_v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        num_kv = new_k.shape[0]
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer], self.queries[layer] = new_k, new_v, new_q
            self.kept[layer] = torch.ones(num_kv, new_k.shape[1], dtype=torch.bool)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], new_k], 1)
            self.values[layer] = torch.cat([self.values[layer], new_v], 1)
            self.queries[layer] = torch.cat([self.queries[layer], new_q], 1)
            ones = torch.ones(num_kv, new_k.shape[1], dtype=torch.bool)
            self.kept[layer] = torch.cat([self.kept[layer], ones], 1)
        total = self.keys[layer].shape[1]
        num_new = new_q.shape[1]
        out = self._attention(layer, new_q, total - num_new, scale, sliding_window)
        self._maybe_compress(layer, total, scale)
        return out.transpose(0, 1).float()

    def _cap(self, logits):
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def _attention(self, layer, queries, first_position, scale, sliding_window=None):
        keys, values, kept = self.keys[layer], self.values[layer], self.kept[layer]
        num_heads, num_kv = queries.shape[0], keys.shape[0]
        group = num_heads // num_kv
        keys = keys.repeat_interleave(group, 0)
        values = values.repeat_interleave(group, 0)
        visible = kept.repeat_interleave(group, 0)[:, None, :].clone()  # [H, 1, T]
        positions = torch.arange(keys.shape[1])
        query_positions = first_position + torch.arange(queries.shape[1])
        causal = positions[None, :] <= query_positions[:, None]  # [n, T]
        if sliding_window is not None:
            causal &= positions[None, :] > query_positions[:, None] - sliding_window
        mask = visible & causal[None]
        scores = self._cap(torch.matmul(queries, keys.transpose(1, 2)) * scale)
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, -1), values)

    def _maybe_compress(self, layer, total, scale):
        budget = self.budgets[layer]
        if budget is None:
            return
        held = int(self.kept[layer][0].sum())
        at_prompt_end = total == self.num_prompt and held > budget
        at_decode_limit = total > self.num_prompt and held >= budget + self.block_size
        if self.head_budgets == "adaptive":
            if at_prompt_end:
                self._compress_adaptive(layer, budget, total, scale)
            return
        if at_prompt_end or at_decode_limit:
            self._compress(layer, budget, total, scale)

    def _head_scores(self, layer, head, slots, total, scale):
        """SnapKV scores ``[n - w]`` of one KV head's older held slots (float64)."""
        queries = self.queries[layer][:, total - self.window :]  # [H, W, d]
        group = queries.shape[0] // self.kept[layer].shape[0]
        keys = self.keys[layer][head, slots]
        n, w = len(slots), self.window
        per_head = []
        for g in range(group):
            logits = self._cap(queries[head * group + g] @ keys.T * scale)
            causal = torch.arange(n)[None, :] <= (n - w + torch.arange(w))[:, None]
            attn = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)[:, : n - w]
            attn = attn.mean(0)
            if self.pooling == "max":
                attn = F.max_pool1d(attn[None, None], self.kernel_size, 1, self.kernel_size // 2)
                attn = attn[0, 0]
            per_head.append(attn)
        return torch.stack(per_head).mean(0)

    def _compress_adaptive(self, layer, budget, total, scale):
        kept = self.kept[layer]
        num_kv, w = kept.shape[0], self.window
        slots = torch.nonzero(kept[0]).flatten()
        n = len(slots)
        scores = [self._head_scores(layer, h, slots, total, scale).float() for h in range(num_kv)]
        safe = max(int(0.2 * budget) - w, 0)
        chosen = []
        for h in range(num_kv):
            order = sorted(range(n - w), key=lambda j: (-float(scores[h][j]), -j))
            chosen.append(set(order[:safe]) | set(range(n - w, n)))
        rest = [(h, j) for h in range(num_kv) for j in range(n - w) if j not in chosen[h]]
        rest.sort(key=lambda item: (-float(scores[item[0]][item[1]]), -item[1], item[0]))
        for h, j in rest[: num_kv * (budget - w - safe)]:
            chosen[h].add(j)
        for h in range(num_kv):
            new_kept = torch.zeros_like(kept[h])
            new_kept[slots[sorted(chosen[h])]] = True
            kept[h] = new_kept

    def _compress(self, layer, budget, total, scale):
        kept = self.kept[layer]
        num_kv = kept.shape[0]
        queries = self.queries[layer][:, total - self.window :]  # [H, W, d]
        num_heads = queries.shape[0]
        group = num_heads // num_kv
        for h in range(num_kv):
            slots = torch.nonzero(kept[h]).flatten()  # held positions, ascending
            keys = self.keys[layer][h, slots]  # [n, d]
            n = len(slots)
            w = self.window
            scores = torch.zeros(n, dtype=torch.float64)
            per_head = []
            for g in range(group):
                qh = queries[h * group + g]  # [W, d]
                logits = self._cap(qh @ keys.T * scale)  # [W, n]
                causal = torch.arange(n)[None, :] <= (n - w + torch.arange(w))[:, None]
                logits = logits.masked_fill(~causal, float("-inf"))
                attn = torch.softmax(logits, -1)[:, : n - w].mean(0)  # [n - w]
                if self.pooling == "max":
                    attn = F.max_pool1d(
                        attn[None, None], self.kernel_size, 1, self.kernel_size // 2
                    )[0, 0]
                per_head.append(attn)
            scores = torch.stack(per_head).mean(0)  # [n - w]
            order = sorted(range(n - w), key=lambda j: (-float(scores[j]), -j))
            chosen = set(order[: budget - w]) | set(range(n - w, n))
            new_kept = torch.zeros_like(kept[h])
            new_kept[slots[sorted(chosen)]] = True
            kept[h] = new_kept

    def kept_positions(self, layer):
        """Per KV head, the sorted kept token positions."""
        return [torch.nonzero(row).flatten().tolist() for row in self.kept[layer]]
