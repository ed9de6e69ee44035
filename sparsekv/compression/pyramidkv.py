"""PyramidKV (Cai et al., arXiv 2406.02069): SnapKV scores under budgets that shrink with depth.

Scoring is SnapKV's unchanged; the per-layer budgets are the paper's linear schedule
(``pyramid_budgets``), the configured budget being the average over budgeted layers. The policy
resolver reads the schedule from ``PyramidKVCompressor.layer_schedule``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsekv.compression.snapkv import SnapKVCompressor

PYRAMID_BETA = 20


def pyramid_budgets(
    budget: int, window: int, num_prompt_tokens: int, num_layers: int, beta: int = PYRAMID_BETA
) -> list[int]:
    """PyramidKV's linearly falling budgets over ``num_layers`` budgeted layers (bottom first).

    The paper's schedule, with ``B = budget`` (average, window included), ``W = window``,
    ``n = num_prompt_tokens``::

        min_num = (B - W) // beta;  max_num = 2 * (B - W) - min_num
        if max_num >= n - W: max_num = n - W; min_num = 2 * (B - W) - max_num
        steps = (max_num - min_num) // (L - 1);  budget_l = max_num - l * steps + W

    Fallbacks: ``n < B`` keeps everything and ``n < 2 * (B - W)`` is uniform SnapKV; both return
    a uniform ``B`` (a layer with ``n <= B`` keeps every prompt token at prefill, and decode
    eviction still works against ``B``). One layer is uniform too. Budgets are clamped to
    ``>= W + 1`` (the smallest valid budget) for tiny ``B - W`` where the schedule reaches ``W``.

    Returns:
        ``num_layers`` budgets in slots.
    """
    if num_prompt_tokens < budget or num_prompt_tokens < 2 * (budget - window) or num_layers < 2:
        return [budget] * num_layers
    min_num = (budget - window) // beta
    max_num = 2 * (budget - window) - min_num
    if max_num >= num_prompt_tokens - window:
        max_num = num_prompt_tokens - window
        min_num = 2 * (budget - window) - max_num
    steps = (max_num - min_num) // (num_layers - 1)
    return [max(window + 1, max_num - layer * steps + window) for layer in range(num_layers)]


@dataclass
class PyramidKVCompressor(SnapKVCompressor):
    """SnapKV scores; only the budgets differ (``layer_schedule`` is the pyramid)."""

    name = "pyramidkv"

    @staticmethod
    def layer_schedule(
        budget: int, window: int, num_prompt_tokens: int, num_layers: int
    ) -> list[int]:
        """``pyramid_budgets`` with the paper's ``beta``."""
        return pyramid_budgets(budget, window, num_prompt_tokens, num_layers)
