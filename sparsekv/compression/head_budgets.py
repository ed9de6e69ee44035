"""Head-wise budgets: one layer budget shared among its KV heads by score (AdaKV).

Ada-KV (Feng et al., arXiv 2407.11550) observes that attention concentration differs between
heads: a flat budget gives a concentrated head slots it does not need and starves a dispersed
one. It keeps the layer's ``num_kv_heads * budget`` highest scores over all heads together, so
heads keep unequal counts, with a safeguard: every head keeps at least a fraction ``alpha`` of
the flat budget (the paper's and kvpress's ``alpha_safeguard``, 0.2).

Here the recent slots a compressor always keeps (``Compressor.num_recent``: the observation
window) count toward each head's safeguard; ties go to the more recent slot, then to the lower
head. kvpress differs in one detail: it ranks the window slots with the rest (their scores are
set to the maximum), which is the same set whenever the window fits in the safeguard.
"""

from __future__ import annotations

import torch

from sparsekv.attention.selection import kept_indices_prefer_recent

SAFEGUARD = 0.2


def adaptive_head_kept(
    scores: torch.Tensor, budget: int, num_recent: int, safeguard: float = SAFEGUARD
) -> list[torch.Tensor]:
    """The slots each KV head keeps when the heads share ``num_kv_heads * budget`` slots.

    Each head keeps its last ``num_recent`` slots and its best ``safe - num_recent`` older
    ones (``safe = int(safeguard * budget)``); the remaining slots of the layer budget go to
    the highest older scores over all heads (ties: the more recent slot, then the lower head).

    Args:
        scores: ``[num_kv_heads, n]`` fp32 slot scores, higher = keep (``Compressor.score``).
        budget: average slots per head, window included; ``num_recent <= budget``.
        num_recent: most recent slots every head keeps regardless of score.
        safeguard: fraction of ``budget`` every head keeps at least, in [0, 1].

    Returns:
        One int64 tensor of ascending slot indices per head; their lengths sum to
        ``num_kv_heads * min(budget, n)``.

    Raises:
        ValueError: ``safeguard`` outside [0, 1] or ``num_recent`` above ``budget``.
    """
    if not 0 <= safeguard <= 1:
        raise ValueError(f"safeguard must be in [0, 1], got {safeguard}")
    if not 0 <= num_recent <= budget:
        raise ValueError(f"num_recent ({num_recent}) must be in [0, budget ({budget})]")
    num_heads, n = scores.shape
    device = scores.device
    if n <= budget:
        return [torch.arange(n, device=device) for _ in range(num_heads)]
    num_older = n - num_recent
    older = scores[:, :num_older].float()
    num_safe = min(max(int(safeguard * budget) - num_recent, 0), budget - num_recent)
    chosen = torch.zeros(num_heads, num_older, dtype=torch.bool, device=device)
    if num_safe:
        chosen.scatter_(1, kept_indices_prefer_recent(older, num_safe), True)
    quota = num_heads * (budget - num_recent - num_safe)
    if quota:
        # Rank the older slots of all heads together: newest slot first, heads in order
        # within a slot, so a stable sort sends ties to the newer slot, then the lower head.
        flat = older.t().flip(0).reshape(-1)
        free = ~chosen.t().flip(0).reshape(-1)
        candidates = free.nonzero().squeeze(1)
        order = torch.sort(flat[candidates], descending=True, stable=True).indices[:quota]
        picked = candidates[order]
        slots = num_older - 1 - picked // num_heads
        chosen[picked % num_heads, slots] = True
    recent = torch.arange(num_older, n, device=device)
    return [torch.cat([row.nonzero().squeeze(1), recent]) for row in chosen]
