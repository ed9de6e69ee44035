"""Packed weight formats: byte layouts, a value object for packed weights, and PyTorch
reference dequantizers.

A packed weight ``[out_features, in_features]`` is a ``uint8`` tensor with one row of bytes per
output feature. The GGUF formats keep llama.cpp's blocks of 32 values (``ggml-common.h``,
``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``) exactly as the file stores them:

- ``q4_0``: fp16 scale ``d``, 16 bytes of 4-bit codes; ``w = d * (q - 8)`` (18 bytes / 32).
- ``q4_1``: fp16 ``d`` and offset ``m``, 16 bytes of codes; ``w = d * q + m`` (20 bytes / 32).
- ``q8_0``: fp16 ``d``, 32 int8 codes; ``w = d * q`` (34 bytes / 32).

Byte ``j`` of a 4-bit block holds value ``j`` in its low nibble and value ``j + 16`` in its high
one. Two formats made at load time from a dense checkpoint:

- ``int8``: per output channel, symmetric: an fp32 scale ``s = max|w| / 127``, then the row's
  int8 codes ``round(w / s)``; ``w = s * q``.
- ``bf16``: the row in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedFormat:
    """One packed layout.

    Attributes:
        name: ``q4_0``, ``q4_1``, ``q8_0``, ``int8`` or ``bf16``.
        code: the native kernels' format number (``csrc/quant.h``).
        block_values: values per block (``in_features`` must be a multiple); 1 for row formats.
        block_bytes: bytes per block.
        row_header: bytes before a row's blocks (the ``int8`` scale).
    """

    name: str
    code: int
    block_values: int
    block_bytes: int
    row_header: int = 0

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one packed row of ``in_features`` weights."""
        return self.row_header + in_features // self.block_values * self.block_bytes


FORMATS: dict[str, PackedFormat] = {
    f.name: f
    for f in (
        PackedFormat("q4_0", 0, 32, 18),
        PackedFormat("q4_1", 1, 32, 20),
        PackedFormat("q8_0", 2, 32, 34),
        PackedFormat("int8", 3, 1, 1, row_header=4),
        PackedFormat("bf16", 4, 1, 2),
    )
}

# GGML type names (``gguf.GGMLQuantizationType``) whose blocks are kept packed.
GGUF_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}


@dataclass(frozen=True)
class PackedTensor:
    """A weight ``[out_features, in_features]`` kept in a packed format.

    Attributes:
        format: a :data:`FORMATS` name.
        in_features: values per row.
        data: ``uint8`` ``[out_features, row_bytes]``, contiguous.
    """

    format: str
    in_features: int
    data: torch.Tensor

    def __post_init__(self) -> None:
        layout = FORMATS[self.format]
        if self.in_features % layout.block_values:
            raise ValueError(
                f"weight: {self.format} needs in_features divisible by {layout.block_values}, "
                f"got {self.in_features}"
            )
        expected = layout.row_bytes(self.in_features)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != expected:
            raise ValueError(
                f"weight: {self.format} rows of {self.in_features} values take {expected} bytes; "
                f"got a {self.data.dtype} tensor of shape {tuple(self.data.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``."""
        return self.data.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes of packed data."""
        return self.data.numel()

    def with_rows(self, data: torch.Tensor) -> PackedTensor:
        """The same format over other rows (a permutation, slice or concatenation of rows)."""
        return PackedTensor(self.format, self.in_features, data.contiguous())


def cat_rows(parts: list[PackedTensor]) -> PackedTensor:
    """Concatenate packed weights of one format and width along the output features.

    Raises:
        ValueError: the parts differ in format or ``in_features``.
    """
    first = parts[0]
    if any(p.format != first.format or p.in_features != first.in_features for p in parts):
        raise ValueError("weight: cannot concatenate packed weights of different formats")
    return first.with_rows(torch.cat([p.data for p in parts]))


def _halves(data: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 values at byte ``offset`` of every block ``[..., block_bytes]`` -> fp32 ``[...]``."""
    return data[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def dequantize_reference(weight: PackedTensor) -> torch.Tensor:
    """``weight`` as a dense fp32 ``[out_features, in_features]`` tensor, in PyTorch.

    The fallback without the native kernels and the reference they are tested against; equal
    bit for bit to ``gguf.quants.dequantize`` for the GGUF formats.
    """
    layout = FORMATS[weight.format]
    rows, k = weight.shape
    data = weight.data
    if weight.format == "int8":
        scale = data[:, :4].contiguous().view(torch.float32)  # [rows, 1]
        return data[:, 4:].view(torch.int8).float() * scale
    if weight.format == "bf16":
        return data.view(torch.bfloat16).float()
    blocks = data.reshape(rows, k // 32, layout.block_bytes)
    d = _halves(blocks, 0).unsqueeze(-1)
    if weight.format == "q8_0":
        return (d * blocks[..., 2:].view(torch.int8).float()).reshape(rows, k)
    codes = blocks[..., -16:]
    q = torch.cat([codes & 0xF, codes >> 4], dim=-1).float()  # [rows, blocks, 32]
    if weight.format == "q4_0":
        return (d * (q - 8.0)).reshape(rows, k)
    return (d * q + _halves(blocks, 2).unsqueeze(-1)).reshape(rows, k)


def quantize_int8(weight: torch.Tensor) -> PackedTensor:
    """Per-output-channel symmetric int8 of a dense ``[out_features, in_features]`` weight.

    ``s = max|w| / 127`` per row in fp32 (1 for an all-zero row), ``q = round(w / s)`` (round
    half to even), so ``|w - s q| <= s / 2``.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    data = torch.cat([scale.view(torch.uint8), codes.view(torch.uint8)], dim=1)
    return PackedTensor("int8", w.shape[1], data.contiguous())


def pack_bf16(weight: torch.Tensor) -> PackedTensor:
    """A dense ``[out_features, in_features]`` weight stored in bf16 rows."""
    rows = weight.detach().to(torch.bfloat16).contiguous()
    return PackedTensor("bf16", rows.shape[1], rows.view(torch.uint8))
