"""Pre-packed bf16 linear layers for CPUs with AMX / AVX512-BF16.

``nn.Linear`` on CPU hands oneDNN a plain row-major weight, which oneDNN reorders into its
blocked layout on every call. At decode batch sizes (1-64 rows) that reorder costs as much as
the matmul itself: measured on a 2-core Sapphire Rapids VM, SmolLM2's four per-layer matmuls
take 0.69 ms at batch 1 plain vs 0.51 ms packed, 0.43 vs 0.31 ms at batch 16 (the reorder is
skipped, results are bit-identical). Packing once at load time is what Intel's extension and
PyTorch's Inductor (weight prepacking on freeze) do; here it is ``torch.ops.mkldnn``'s reorder
and pointwise-linear ops, the same ones Inductor emits.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for; any row count works with it.
BATCH_HINT = 16


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in oneDNN's blocked layout (inference only).

    Args:
        linear: the bf16 ``nn.Linear`` to pack (its weight is copied into the packed layout).

    ``forward``: ``x`` ``[..., in_features]`` bf16 -> ``[..., out_features]`` bf16, bit-identical
    to ``linear(x)``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        )
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_prepack(dtype: torch.dtype, device: str, native_bf16: bool) -> bool:
    """Whether packing pays: bf16 weights on a CPU with native bf16 matmul (``native_bf16``:
    AMX or AVX512-BF16), and a PyTorch build whose oneDNN exposes the packing ops."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu" or not native_bf16:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


def prepack_linears(model: nn.Module) -> int:
    """Replace every bf16 ``nn.Linear`` of ``model`` by a ``PackedLinear``, in place.

    A tied ``lm_head`` gets its own packed copy (the embedding keeps the plain weight). If the
    first packed layer does not reproduce ``nn.Linear`` exactly, nothing is replaced.

    Returns:
        The number of layers packed (0 when packing is unavailable or failed its check).
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16
    ]
    if not targets or not _packing_is_exact(targets[0][2]):
        return 0
    with torch.no_grad():
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear(child))
    return len(targets)


def _packing_is_exact(linear: nn.Linear) -> bool:
    try:
        with torch.no_grad():
            x = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
            same = torch.equal(PackedLinear(linear)(x), linear(x))
    except RuntimeError as exc:  # an oneDNN build without bf16 packing
        logger.warning("bf16 weight prepacking unavailable (%s); using nn.Linear", exc)
        return False
    if not same:
        logger.warning("bf16 weight prepacking changed results; using nn.Linear")
    return same
