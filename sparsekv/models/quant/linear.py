"""A linear layer whose weight stays packed (GGUF blocks, int8 per channel, bf16 rows).

:class:`QuantizedLinear` replaces an ``nn.Linear`` of the decoder; its weight may be the row
concatenation of several packed parts (the fused QKV and gate/up projections of a GGUF file
whose q, k, v tensors were stored separately, possibly in different formats). Decode-sized
inputs run the native kernels on the packed bytes; prefill-sized ones dequantize tiles for a
dense matmul (``ops``).
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekv.models.quant import ops
from sparsekv.models.quant.formats import PackedTensor


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` kept packed (inference only).

    Args:
        parts: the weight's row blocks, in output-feature order, all with the same
            ``in_features``.
        bias: ``[out_features]`` or ``None``; kept in fp32 (exact for a bf16 bias), the dtype
            the kernel op adds it in.

    Raises:
        ValueError: no parts, or parts of different ``in_features``.

    ``forward``: ``x`` ``[..., in_features]`` fp32 or bf16 -> ``[..., out_features]`` in ``x``'s
    dtype. Up to ``ops.SMALL_M_MAX_ROWS`` rows accumulate in fp32 on the packed weight, add the
    bias in fp32 and round once to ``x``'s dtype inside the kernel op (bf16 ``x`` is read as it
    is by the ``avx512_bf16`` kernels of Q4_0 / Q4_1 / Q8_0; other formats and variants convert
    it to fp32 inside the op); more rows multiply densely in ``x``'s dtype.
    """

    def __init__(self, parts: list[PackedTensor], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("weight: packed parts must share in_features")
        self.in_features = parts[0].in_features
        self.out_features = sum(p.shape[0] for p in parts)
        self.formats = tuple(p.format for p in parts)
        for i, part in enumerate(parts):
            self.register_buffer(f"packed_{i}", part.data)
        bias = None if bias is None else bias.detach().to(torch.float32, copy=True)
        self.register_buffer("bias", bias)

    @property
    def parts(self) -> list[PackedTensor]:
        """The packed row blocks (views of this module's buffers)."""
        return [
            PackedTensor(fmt, self.in_features, getattr(self, f"packed_{i}"))
            for i, fmt in enumerate(self.formats)
        ]

    @property
    def weight_bytes(self) -> int:
        """Bytes of packed weight data (bias excluded)."""
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= ops.SMALL_M_MAX_ROWS:
            y = ops.matmul(rows, self.parts, self.bias)
        else:
            y = ops.dense_matmul(rows, self.parts)
            if self.bias is not None:
                y += self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"formats={'+'.join(self.formats)}, bias={self.bias is not None}"
        )
