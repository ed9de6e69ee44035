"""Expected Attention (Devoto et al., arXiv 2510.00636, kvpress's ``ExpectedAttentionPress``).

A query-agnostic score with no second pass: the queries still to come are modelled as a
Gaussian fitted to the recent queries of each head, and a key is scored by the attention those
future queries are expected to give it.

1. Statistics: mean ``mu`` and covariance ``Sigma`` (divided by the row count) of the window's
   queries, each first rotated to the RoPE frame of the newest window position (query ``i`` sits
   ``w - 1 - i`` positions before it), so the rows are comparable as if taken pre-RoPE.
2. Future positions: the RoPE rotation averaged over the next ``n_future`` positions,
   ``M = mean_{t=1..n_future} R(t)``, moves them forward: ``mu' = M mu``,
   ``Sigma' = M Sigma M^T``.
3. Closed form: with ``q ~ N(mu', Sigma')`` and logit ``s * q.k``, ``E[exp(s q.k)] =
   exp(s mu'.k + s^2 k^T Sigma' k / 2)`` (the Gaussian moment generating function); the exponent
   is softmaxed over the scored slots, averaged over a KV group's query heads (``gqa_agg``) and
   multiplied by each value's L2 norm.
4. The first ``sinks`` slots (attention sinks) always stay (score ``+inf``).

Where this differs from kvpress: the statistics come from the observation window's queries
(kvpress takes every prompt query's hidden state, pre-RoPE); the window's slots are kept by the
base like every method here; without the model's RoPE frequencies (``LayerView.rope_inv_freq``
``None``) the statistics are used as they are (no rotation averaging); a soft-capped model's
logits are scored uncapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.compression.base import Compressor, LayerView
from sparsekv.compression.scoring import aggregate_gqa


@dataclass
class ExpectedAttentionCompressor(Compressor):
    """Expected attention of future queries (module docstring).

    Attributes:
        n_future: future positions the RoPE rotation is averaged over (kvpress: 512).
        sinks: leading slots always kept (kvpress: 4).
        use_covariance: add the covariance term (kvpress: on).
        use_vnorm: multiply by the value norm (kvpress: on).
    """

    name = "expected_attention"
    # Each layer brings its own RoPE frequencies, so layers are never stacked into one view.
    stackable = False

    n_future: int = 512
    sinks: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True

    def score(self, view: LayerView) -> torch.Tensor:
        """``[num_kv_heads, n]`` fp32; the first ``sinks`` slots score ``+inf``."""
        mean, cov = self.future_query_statistics(view.window_queries, view.rope_inv_freq)
        num_kv_heads, n, head_dim = view.keys.shape
        group = mean.shape[0] // num_kv_heads
        keys = view.keys.float().repeat_interleave(group, dim=0)  # [H, n, d]
        logits = torch.einsum("hnd,hd->hn", keys, mean) * view.scale
        if cov is not None:
            quad = torch.einsum("hnd,hde,hne->hn", keys, cov, keys)
            logits = logits + 0.5 * view.scale**2 * quad
        sinks = min(self.sinks, n)
        probs = torch.softmax(logits[:, sinks:], dim=-1)  # [H, n - sinks]
        scores = aggregate_gqa(probs, num_kv_heads, self.gqa_agg)
        if self.use_vnorm:
            scores = scores * torch.linalg.vector_norm(view.values[:, sinks:].float(), dim=-1)
        kept = scores.new_full((num_kv_heads, sinks), float("inf"))
        return torch.cat([kept, scores], dim=1)

    def future_query_statistics(
        self, queries: torch.Tensor, inv_freq: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean and covariance of the next ``n_future`` queries per head (steps 1-2).

        Args:
            queries: ``[num_heads, w, head_dim]`` post-RoPE queries of ``w`` consecutive
                positions, the newest last.
            inv_freq: ``[r // 2]`` RoPE frequencies (radians per position) of the layer, in
                the rotate-half layout over the leading ``r <= head_dim`` dimensions; ``None``:
                no rotation.

        Returns:
            ``mean`` ``[num_heads, head_dim]`` and ``cov`` ``[num_heads, head_dim, head_dim]``
            fp32 (``None`` when ``use_covariance`` is off).
        """
        q = queries.float()
        num_window, head_dim = q.shape[1], q.shape[2]
        if inv_freq is not None:
            offsets = torch.arange(num_window - 1, -1, -1, dtype=torch.float32, device=q.device)
            q = rotate(q, offsets[:, None] * inv_freq.float().to(q.device))
        mean = q.mean(dim=1)  # [H, d]
        cov = None
        if self.use_covariance:
            centred = q - mean[:, None]
            cov = centred.transpose(1, 2) @ centred / num_window  # [H, d, d]
        if inv_freq is None:
            return mean, cov
        m = mean_rotation(inv_freq.float().to(q.device), head_dim, self.n_future)
        mean = mean @ m.T
        if cov is not None:
            cov = m @ cov @ m.T
        return mean, cov


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """RoPE rotation of ``x`` ``[..., rows, head_dim]`` by ``angles`` ``[rows, r // 2]`` radians
    (rotate-half layout over the leading ``r`` dimensions; the others pass through)."""
    half = angles.shape[-1]
    cos, sin = angles.cos(), angles.sin()
    first, second, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin, rest], dim=-1)


def mean_rotation(inv_freq: torch.Tensor, head_dim: int, n_future: int) -> torch.Tensor:
    """``[head_dim, head_dim]`` fp32 mean of the RoPE rotation matrices ``R(t)``, ``t = 1..n_future``.

    Per frequency ``f`` the mean of ``[[cos tf, -sin tf], [sin tf, cos tf]]`` over ``t``; the
    dimensions past the rotated ones keep the identity.
    """
    half = inv_freq.shape[0]
    steps = torch.arange(1, n_future + 1, dtype=torch.float32, device=inv_freq.device)
    angles = steps[:, None] * inv_freq[None]  # [n_future, half]
    cos, sin = angles.cos().mean(0), angles.sin().mean(0)
    m = torch.eye(head_dim, dtype=torch.float32, device=inv_freq.device)
    index = torch.arange(half, device=inv_freq.device)
    m[index, index] = cos
    m[index + half, index + half] = cos
    m[index, index + half] = -sin
    m[index + half, index] = sin
    return m
