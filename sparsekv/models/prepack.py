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

# Weights up to this size also keep their plain row-major copy for the native batch-1 GEMV
# (``models.fused``, AVX512-BF16): oneDNN's per-call setup (~30 us on the 2-core test VM) costs
# as much as reading such a weight, while larger ones are bandwidth-bound either way and are not
# worth a second copy (SmolLM2-135M: every layer but the lm_head, +208 MB; a 1B model: none).
GEMV_MAX_WEIGHT_BYTES = 8 << 20


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in oneDNN's blocked layout (inference only).

    Args:
        linear: the bf16 ``nn.Linear`` to pack (its weight is copied into the packed layout).

    ``forward``: ``x`` ``[..., in_features]`` bf16 -> ``[..., out_features]`` bf16, bit-identical
    to ``linear(x)``. A single row (decode at batch 1) of a small bias-free layer goes through the
    native GEMV instead where the CPU has AVX512-BF16 (same fp32 accumulation and final rounding;
    checked equal at packing time).
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
        # The overload itself: calling the packet re-resolves it on every call (121 per step).
        self._linear = torch.ops.mkldnn._linear_pointwise.default
        self._gemv, self._plain_weight = None, None
        gemv = _gemv_op()
        small = weight.numel() * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES
        if gemv is not None and small and bias is None:
            # Not a buffer: a second copy of the same parameter, kept out of the state dict.
            self._plain_weight = weight.contiguous()
            self._gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemv is not None and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous():
            return self._gemv(x, self._plain_weight)
        return self._linear(x, self.packed_weight, self.bias, "none", [], "")


def _gemv_op():
    """The native bf16 GEMV (``torch.ops.sparsekv_fused.gemv_bf16``) where this CPU runs it."""
    from sparsekv.models.fused import build

    ext = build.load_extension()
    if ext is None or not hasattr(ext, "gemv_bf16") or not ext.has_gemv_bf16():
        return None
    return ext.gemv_bf16.default


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
            packed = PackedLinear(linear)
            same = torch.equal(packed(x), linear(x))
            same = same and all(
                torch.equal(packed(x[i : i + 1]), linear(x[i : i + 1])) for i in range(3)
            )
    except RuntimeError as exc:  # an oneDNN build without bf16 packing
        logger.warning("bf16 weight prepacking unavailable (%s); using nn.Linear", exc)
        return False
    if not same:
        logger.warning("bf16 weight prepacking changed results; using nn.Linear")
    return same
