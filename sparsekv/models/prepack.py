"""Pre-packed linear layers: bf16 on CPUs with AMX / AVX512-BF16, fp32 on the others.

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

from sparsekv.env_flags import switched_off

logger = logging.getLogger(__name__)

# Row count oneDNN tunes the packed layout for; any row count works with it.
BATCH_HINT = 16

# Weights up to this size also keep their plain row-major copy for the native kernels of few
# rows (``models.fused``: the batch-1 GEMV, AVX512-BF16, and the small-M GEMM, AMX): oneDNN's
# per-call setup (~30 us on the 2-core test VM) costs as much as reading such a weight, while
# larger ones gain 5-10% and are not worth a second copy (SmolLM2-135M: every layer but the
# lm_head, +208 MB; a 1B model: none). A weight shared with an embedding (a tied lm_head) needs
# no copy, and uses the native kernels at any size.
GEMV_MAX_WEIGHT_BYTES = 8 << 20

# ``SPARSEKV_FP32_PREPACK=0`` (or ``false``, ``off``, ``no``) keeps fp32 linears as
# ``nn.Linear`` where they would be packed (results then equal MKL's ``nn.Linear`` bit for bit).
FP32_PREPACK_ENV = "SPARSEKV_FP32_PREPACK"

# Row counts from 2 up to this go through the native small-M GEMM (AMX) instead of oneDNN. It
# reads the plain weight once for up to 32 rows, with no per-call setup: on the 2-core test VM
# (one thread, SmolLM2 shapes) 1.1-2.7x faster than the packed oneDNN linear at 2-16 rows and
# 1.05-1.6x at 32 (``python -m sparsekv.models.fused.bench --gemm``); above 32 rows it would
# read each weight tile twice while oneDNN's blocking starts to pay.
SMALL_GEMM_MAX_ROWS = 32


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored in oneDNN's blocked layout (inference only).

    Args:
        linear: the bf16 or fp32 ``nn.Linear`` to pack (its weight is copied into the packed
            layout).
        shared_weight: ``linear.weight`` is also held elsewhere (a tied lm_head): keeping it for
            the native kernels costs no memory, whatever its size.
        native: allow the native kernels (False: oneDNN for every row count; they take bf16
            only).

    ``forward``: ``x`` ``[..., in_features]`` -> ``[..., out_features]`` in the weight's dtype;
    bf16 bit-identical to ``linear(x)`` through oneDNN, fp32 within fp32 rounding of it (MKL
    runs ``nn.Linear`` in fp32). A bf16 bias-free layer whose plain weight is kept (see
    ``GEMV_MAX_WEIGHT_BYTES``) runs decode-sized inputs ``[rows, in_features]`` natively
    instead: one row through the GEMV where the CPU has AVX512-BF16 (weights up to
    ``GEMV_MAX_WEIGHT_BYTES``), up to ``SMALL_GEMM_MAX_ROWS`` rows through the small-M GEMM
    where it has AMX. Both accumulate
    exact bf16 products in fp32 and round once, as oneDNN does (equal to it on the test VM;
    checked within bf16 tolerance at packing time).
    """

    def __init__(self, linear: nn.Linear, shared_weight: bool = False, native: bool = True) -> None:
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
        self._gemv, self._small_gemm, self._plain_weight = None, None, None
        gemv, small_gemm = _native_ops() if native else (None, None)
        small = weight.numel() * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES
        keep_plain = (small or shared_weight) and weight.is_contiguous()
        if (gemv is not None or small_gemm is not None) and keep_plain and bias is None:
            # Not a buffer: a second copy of the same parameter, kept out of the state dict.
            self._plain_weight = weight
            # The GEMV only up to the size it was tuned and checked for: on a larger (tied)
            # weight one row goes through the small-M GEMM, which matched oneDNN bit for bit on
            # the test VM where the GEMV's order of sums did not (49152 x 576).
            self._gemv = gemv if small else None
            self._small_gemm = small_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._plain_weight is not None and x.dim() == 2:
            rows = x.shape[0]
            if rows == 1 and self._gemv is not None and x.is_contiguous():
                return self._gemv(x, self._plain_weight)
            if 1 <= rows <= SMALL_GEMM_MAX_ROWS and self._small_gemm is not None:
                return self._small_gemm(x, self._plain_weight)
        return self.onednn(x)

    def leading_rows_forward(self, x: torch.Tensor, num_rows: int) -> torch.Tensor:
        """``forward(x)[..., :num_rows]``: the first ``num_rows`` outputs only.

        Args:
            x: ``[rows, in_features]`` bf16 (or ``[..., in_features]``).
            num_rows: outputs wanted, in ``[1, out_features]``.

        Returns:
            ``[..., num_rows]`` bf16. Where :meth:`reads_plain_rows` holds, only the plain
            weight's first ``num_rows`` rows (a view) are read, by the native kernel
            ``forward`` would use; otherwise every output is computed and sliced.

        Raises:
            ValueError: ``num_rows`` is not in ``[1, out_features]``.
        """
        if not 1 <= num_rows <= self.out_features:
            raise ValueError(f"num_rows: must be in [1, {self.out_features}], got {num_rows}")
        kernel = self._plain_kernel(x.shape[0], x.is_contiguous()) if x.dim() == 2 else None
        if kernel is not None:
            return kernel(x, self._plain_weight[:num_rows])
        return self.forward(x)[..., :num_rows]

    def reads_plain_rows(self, rows: int | None) -> bool:
        """Whether a contiguous input of ``rows`` rows (``None``: not 2-D) runs the native
        kernels on the kept plain weight, whose leading rows :meth:`leading_rows_forward` can
        then read alone."""
        return rows is not None and self._plain_kernel(rows, True) is not None

    def _plain_kernel(self, rows: int, contiguous: bool):
        """The native kernel ``forward`` runs on the plain weight for ``rows`` rows, or ``None``
        (oneDNN). ``forward`` makes the same choice inline: it runs ~120 times a step."""
        if self._plain_weight is None:
            return None
        if rows == 1 and self._gemv is not None and contiguous:
            return self._gemv
        if 1 <= rows <= SMALL_GEMM_MAX_ROWS and self._small_gemm is not None:
            return self._small_gemm
        return None

    @property
    def packed_bytes(self) -> int:
        """Bytes of oneDNN's packed weight (an opaque tensor: counted at its logical size)."""
        return self.in_features * self.out_features * self.packed_weight.element_size()

    def plain_tensors(self) -> list[torch.Tensor]:
        """The ordinary tensors this layer holds beside the packed weight: the bias and the
        plain weight kept for the native kernels (a tied head's is the embedding's)."""
        return [t for t in (self.bias, self._plain_weight) if t is not None]

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """``linear(x)`` through oneDNN's packed weight, for any row count."""
        return self._linear(x, self.packed_weight, self.bias, "none", [], "")


def _native_ops():
    """(GEMV, small-M GEMM): the native bf16 kernels (``torch.ops.sparsekv_fused.gemv_bf16``,
    ``gemm_bf16_small``), each ``None`` where this CPU (or the build) does not run it or
    ``SPARSEKV_KERNEL_ISA`` rules it out (``fused.ops.bf16_matmul_kernels_allowed``)."""
    from sparsekv.models.fused import build
    from sparsekv.models.fused import ops as fused_ops

    ext = build.load_extension()
    if ext is None:
        return None, None
    gemv_allowed, gemm_allowed = fused_ops.bf16_matmul_kernels_allowed()
    gemv = ext.gemv_bf16.default if gemv_allowed and ext.has_gemv_bf16() else None
    small_gemm = ext.gemm_bf16_small.default if gemm_allowed and ext.has_gemm_bf16_small() else None
    return gemv, small_gemm


def can_prepack(dtype: torch.dtype, device: str, native_bf16: bool) -> bool:
    """Whether packing pays, on CPU with a PyTorch build whose oneDNN exposes the packing ops:
    bf16 weights where the CPU has native bf16 matmul (``native_bf16``: AMX or AVX512-BF16),
    or fp32 weights where it has not (what ``--dtype auto`` picks there).

    fp32 is not packed on bf16 CPUs (fp32 there is an explicit choice, usually to compare
    with references that run ``nn.Linear``, which packing would move by fp32 rounding), nor
    where ``SPARSEKV_FP32_PREPACK`` is off."""
    if torch.device(device).type != "cpu":
        return False
    if dtype == torch.float32 and switched_off(FP32_PREPACK_ENV):
        return False
    if not (
        (dtype == torch.bfloat16 and native_bf16) or (dtype == torch.float32 and not native_bf16)
    ):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(
        torch.ops.mkldnn, "_linear_pointwise"
    )


def prepack_linears(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Replace every ``nn.Linear`` of ``model`` whose weight is ``dtype`` (bf16 or fp32) by a
    ``PackedLinear``, in place.

    bf16: a tied ``lm_head`` gets its own packed copy (the embedding keeps the plain weight,
    which the native kernels then read). If the first packed layer does not reproduce
    ``nn.Linear`` exactly through oneDNN, nothing is replaced; if the native kernels are off by
    more than bf16 rounding on it, only oneDNN is used.

    fp32 (oneDNN only: its packed layout also skips the per-call reorder that ``nn.Linear``'s
    plain weight costs, most at decode row counts): results differ from ``nn.Linear`` by fp32
    rounding, so the check is that the packed layer is within it of a float64 product. The
    output head (``model.lm_head``) stays ``nn.Linear``: packed, a tied one would add the
    embedding's size, and any would lose the sparse self-draft's read of its leading rows.

    Each layer's plain weight is released as soon as its packed copy exists (peak memory: one
    layer more, not a second model).

    Returns:
        The number of layers packed (0 when packing is unavailable or failed its check).
    """
    if dtype not in (torch.bfloat16, torch.float32):
        return 0
    head = getattr(model, "lm_head", None) if dtype == torch.float32 else None
    embedded = {
        module.weight.data_ptr() for module in model.modules() if isinstance(module, nn.Embedding)
    }
    sites = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and child.weight.dtype == dtype and child is not head
    ]
    if not sites:
        return 0
    exact, native = _check_packing(getattr(*sites[0]))
    if not exact:
        return 0
    with torch.no_grad():
        for parent, name in sites:
            child = getattr(parent, name)
            shared = child.weight.data_ptr() in embedded
            setattr(parent, name, PackedLinear(child, shared_weight=shared, native=native))
            del child
    return len(sites)


# Row counts the packing check runs: the GEMV, the small-M GEMM at one and at two x tiles.
_CHECK_ROWS = (1, 2, 3, 17)


def _check_packing(linear: nn.Linear) -> tuple[bool, bool]:
    """(oneDNN's packed linear equals ``linear`` exactly (fp32: is as close to a float64
    product as ``linear``, within fp32 rounding), the native kernels are within bf16 rounding
    of an fp32 reference) on random inputs of a few row counts. fp32 never runs the native
    kernels (they take bf16)."""
    if linear.weight.dtype == torch.float32:
        return _check_fp32_packing(linear), False
    try:
        with torch.no_grad():
            x = torch.randn(max(_CHECK_ROWS), linear.in_features, dtype=linear.weight.dtype)
            packed = PackedLinear(linear)
            exact = all(
                torch.equal(packed.onednn(x[:rows]), linear(x[:rows])) for rows in _CHECK_ROWS
            )
            reference = nn.functional.linear(x.float(), linear.weight.float())
            if linear.bias is not None:
                reference += linear.bias.float()
            native = all(
                torch.allclose(packed(x[:rows]).float(), reference[:rows], rtol=1.6e-2, atol=1e-2)
                for rows in _CHECK_ROWS
            )
    except RuntimeError as exc:  # an oneDNN build without bf16 packing
        logger.warning("bf16 weight prepacking unavailable (%s); using nn.Linear", exc)
        return False, False
    if not exact:
        logger.warning("bf16 weight prepacking changed results; using nn.Linear")
    elif not native:
        logger.warning("native bf16 linear kernels off by more than rounding; using oneDNN")
    return exact, native


def _check_fp32_packing(linear: nn.Linear) -> bool:
    """Whether oneDNN's packed fp32 linear is within fp32 rounding of a float64 product (as
    ``nn.Linear`` is): ``|y - y64| <= 1e-5 * (|x| @ |W|^T)`` elementwise, at a few row counts."""
    try:
        with torch.no_grad():
            x = torch.randn(max(_CHECK_ROWS), linear.in_features)
            packed = PackedLinear(linear, native=False)
            weight = linear.weight.double()
            bound = 1e-5 * (x.double().abs() @ weight.abs().t()) + 1e-30
            reference = x.double() @ weight.t()
            if linear.bias is not None:
                reference += linear.bias.double()
            close = True
            for rows in _CHECK_ROWS:
                error = (packed.onednn(x[:rows]).double() - reference[:rows]).abs()
                close = close and bool((error <= bound[:rows]).all())
    except RuntimeError as exc:  # an oneDNN build without fp32 packing
        logger.warning("fp32 weight prepacking unavailable (%s); using nn.Linear", exc)
        return False
    if not close:
        logger.warning("fp32 weight prepacking moved results past fp32 rounding; using nn.Linear")
    return close
