"""Packed weight formats: byte layouts, a value object for packed weights, and PyTorch
reference dequantizers.

A packed weight ``[out_features, in_features]`` is a ``uint8`` tensor with one row of bytes per
output feature. The GGUF formats keep llama.cpp's blocks of 32 values (``ggml-common.h``,
``block_q4_0`` / ``block_q4_1`` / ``block_q8_0``) exactly as the file stores them:

- ``q4_0``: fp16 scale ``d``, 16 bytes of 4-bit codes; ``w = d * (q - 8)`` (18 bytes / 32).
- ``q4_1``: fp16 ``d`` and offset ``m``, 16 bytes of codes; ``w = d * q + m`` (20 bytes / 32).
- ``q8_0``: fp16 ``d``, 32 int8 codes; ``w = d * q`` (34 bytes / 32).
- ``q5_0``: fp16 ``d``, a 32-bit word of fifth bits ``qh``, 16 bytes of nibbles; value ``j``'s
  code is its nibble plus ``16 *`` bit ``j`` of ``qh``; ``w = d * (q - 16)`` (22 bytes / 32).

Byte ``j`` of a 4-bit block holds value ``j`` in its low nibble and value ``j + 16`` in its high
one. The k-quants (``block_q4_K`` / ``block_q6_K``) group 256 values in a super-block:

- ``q4_k``: fp16 ``d`` and ``dmin``, 12 bytes of 6-bit scales ``sc`` and mins ``m`` of 8
  sub-blocks of 32, 128 bytes of nibbles (bytes ``32c .. 32c + 31``: sub-block ``2c`` in the low
  nibbles, ``2c + 1`` in the high ones); ``w = d * sc * q - dmin * m`` (144 bytes / 256).
- ``q6_k``: 128 bytes of low nibbles ``ql``, 64 bytes of 2-bit highs ``qh``, 16 int8 scales of
  sub-blocks of 16, fp16 ``d``; ``w = d * scale * (q - 32)`` (210 bytes / 256). Half ``h`` of
  128 values: ``ql`` bytes ``64h + i`` hold values ``i`` (low nibble) and ``64 + i`` (high);
  bits ``2t, 2t + 1`` of ``qh`` byte ``32h + i`` are the top bits of value ``32t + i``. Two formats made at load time from a dense checkpoint:

- ``int8``: per output channel, symmetric: an fp32 scale ``s = max|w| / 127``, then the row's
  int8 codes ``round(w / s)``; ``w = s * q``.
- ``bf16``: the row in bf16.

And the GGUF blocks repacked at load for the int8-activation kernels (bf16 models on CPUs with
AVX512-VNNI): ``q4_0x16``, ``q4_1x16``, ``q8_0x16`` hold 16 weight rows per packed row, their
blocks interleaved so that one integer dot-product instruction advances all 16 (layout at
:data:`FORMATS`); they dequantize to exactly the values of their source format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedFormat:
    """One packed layout.

    Attributes:
        name: ``q4_0``, ``q4_1``, ``q8_0``, ``q5_0``, ``q4_k``, ``q6_k``, ``int8``, ``bf16``,
            or an x16 group layout (``q4_0x16``, ``q4_1x16``, ``q8_0x16``).
        code: the native kernels' format number (``csrc/quant.h``).
        block_values: values per block (``in_features`` must be a multiple); 1 for row formats.
        block_bytes: bytes per block.
        row_header: bytes before a row's blocks (the ``int8`` scale).
        group_rows: weight rows one row of the packed tensor holds (16 for the ``x16`` group
            layouts, whose blocks interleave 16 weight rows; else 1).
    """

    name: str
    code: int
    block_values: int
    block_bytes: int
    row_header: int = 0
    group_rows: int = 1

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one packed row (``group_rows`` weight rows) of ``in_features`` weights."""
        return self.row_header + in_features // self.block_values * self.block_bytes


FORMATS: dict[str, PackedFormat] = {
    f.name: f
    for f in (
        PackedFormat("q4_0", 0, 32, 18),
        PackedFormat("q4_1", 1, 32, 20),
        PackedFormat("q8_0", 2, 32, 34),
        PackedFormat("int8", 3, 1, 1, row_header=4),
        PackedFormat("bf16", 4, 1, 2),
        PackedFormat("q4_k", 5, 256, 144),
        PackedFormat("q6_k", 6, 256, 210),
        PackedFormat("q5_0", 7, 32, 22),
        # Q4_0 / Q4_1 / Q8_0 repacked in groups of 16 rows for the int8-activation kernels
        # (csrc/quant.h): per group and block of 32, the 16 fp16 scales d (and Q4_1's 16 fp16
        # offsets m), then code vectors of 64 bytes whose 4-byte word i holds row i's code bytes
        # 4t .. 4t + 3 (vector t; Q8_0's codes stored as q + 128). Same bytes per value.
        PackedFormat("q4_0x16", 8, 32, 16 * 18, group_rows=16),
        PackedFormat("q4_1x16", 9, 32, 16 * 20, group_rows=16),
        PackedFormat("q8_0x16", 10, 32, 16 * 34, group_rows=16),
    )
}

# The x16 group layout of each format that has one.
X16_FORMATS = {"q4_0": "q4_0x16", "q4_1": "q4_1x16", "q8_0": "q8_0x16"}

# GGML type names (``gguf.GGMLQuantizationType``) whose blocks are kept packed.
GGUF_FORMATS = {
    "Q4_0": "q4_0",
    "Q4_1": "q4_1",
    "Q8_0": "q8_0",
    "Q5_0": "q5_0",
    "Q4_K": "q4_k",
    "Q6_K": "q6_k",
}


@dataclass(frozen=True)
class PackedTensor:
    """A weight ``[out_features, in_features]`` kept in a packed format.

    Attributes:
        format: a :data:`FORMATS` name.
        in_features: values per row.
        data: ``uint8`` ``[out_features / group_rows, row_bytes]``, contiguous
            (``group_rows`` and ``row_bytes`` of the format).
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
        return self.data.shape[0] * FORMATS[self.format].group_rows, self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes of packed data."""
        return self.data.numel()

    def with_rows(self, data: torch.Tensor) -> PackedTensor:
        """The same format over other rows of the packed tensor (a permutation, slice or
        concatenation; for an x16 format, of groups of 16 weight rows)."""
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
    if FORMATS[weight.format].group_rows > 1:
        return dequantize_reference(unpack_x16_reference(weight))
    layout = FORMATS[weight.format]
    rows, k = weight.shape
    data = weight.data
    if weight.format == "int8":
        scale = data[:, :4].contiguous().view(torch.float32)  # [rows, 1]
        return data[:, 4:].view(torch.int8).float() * scale
    if weight.format == "bf16":
        return data.view(torch.bfloat16).float()
    blocks = data.reshape(rows, k // layout.block_values, layout.block_bytes)
    if weight.format in _SUPER_BLOCK_DEQUANTIZERS:
        return _SUPER_BLOCK_DEQUANTIZERS[weight.format](blocks).reshape(rows, k)
    d = _halves(blocks, 0).unsqueeze(-1)
    if weight.format == "q8_0":
        return (d * blocks[..., 2:].view(torch.int8).float()).reshape(rows, k)
    codes = blocks[..., -16:]
    q = torch.cat([codes & 0xF, codes >> 4], dim=-1).float()  # [rows, blocks, 32]
    if weight.format == "q5_0":
        high = blocks[..., 2:6].contiguous().view(torch.int32)  # [rows, blocks, 1]
        bits = (high >> torch.arange(32, dtype=torch.int32)) & 1
        return (d * (q + 16.0 * bits.float() - 16.0)).reshape(rows, k)
    if weight.format == "q4_0":
        return (d * (q - 8.0)).reshape(rows, k)
    return (d * q + _halves(blocks, 2).unsqueeze(-1)).reshape(rows, k)


def unpack_x16_reference(weight: PackedTensor) -> PackedTensor:
    """An x16 weight back in its source format (Q4_0 / Q4_1 / Q8_0 rows), in PyTorch: the
    inverse of the native ``repack_x16``."""
    source = weight.format.removesuffix("x16")
    block_bytes = FORMATS[source].block_bytes
    groups, k = weight.data.shape[0], weight.in_features
    blocks = k // 32
    header = 64 if source == "q4_1" else 32
    data = weight.data.reshape(groups, blocks, -1)
    heads = data[..., :header].reshape(groups, blocks, header // 32, 16, 2)
    heads = heads.permute(0, 3, 1, 2, 4).reshape(groups * 16, blocks, header // 16)
    codes = data[..., header:].reshape(groups, blocks, -1, 16, 4)  # [g, b, vector, row, 4]
    codes = codes.permute(0, 3, 1, 2, 4).reshape(groups * 16, blocks, block_bytes - header // 16)
    if source == "q8_0":
        codes = codes ^ 0x80
    rows = torch.cat([heads, codes], dim=-1).reshape(groups * 16, -1).contiguous()
    return PackedTensor(source, k, rows)


def _q4_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks ``[..., 144]`` -> fp32 values ``[..., 256]``."""
    d, dmin = _halves(blocks, 0).unsqueeze(-1), _halves(blocks, 2).unsqueeze(-1)
    s = blocks[..., 4:16].long()
    low, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([low & 63, (top & 15) | ((low >> 6) << 4)], dim=-1).float()
    mins = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=-1).float()
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, 32)
    q = torch.cat([qs & 0xF, qs >> 4], dim=-2).reshape(*blocks.shape[:-1], 8, 32).float()
    values = (d * sc).unsqueeze(-1) * q - (dmin * mins).unsqueeze(-1)
    return values.flatten(-2)


def _q6_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks ``[..., 210]`` -> fp32 values ``[..., 256]``."""
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 1, 64)
    ql = torch.cat([ql & 0xF, ql >> 4], dim=-2).reshape(*lead, 2, 128)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    qh = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2).reshape(*lead, 2, 128)
    q = ((ql | (qh << 4)).float() - 32.0).reshape(*lead, 16, 16)
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    d = _halves(blocks, 208).unsqueeze(-1)
    return ((d * scales).unsqueeze(-1) * q).flatten(-2)


_SUPER_BLOCK_DEQUANTIZERS = {"q4_k": _q4_k_values, "q6_k": _q6_k_values}


def quantize_int8(weight: torch.Tensor, code_max: int = 127) -> PackedTensor:
    """Per-output-channel symmetric int8 of a dense ``[out_features, in_features]`` weight.

    ``s = max|w| / code_max`` per row in fp32 (1 for an all-zero row), ``q = round(w / s)``
    (round half to even), so ``|w - s q| <= s / 2``. ``code_max`` below 127 keeps the codes
    within an int8 GEMM's exact range (``int8_rows.SATURATING_GEMM_CODE_MAX``: 7 bits).

    Raises:
        ValueError: ``code_max`` outside [1, 127].
    """
    if not 1 <= code_max <= 127:
        raise ValueError(f"code_max must be in [1, 127], got {code_max}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / float(code_max)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale).clamp_(-code_max, code_max).to(torch.int8)
    data = torch.cat([scale.view(torch.uint8), codes.view(torch.uint8)], dim=1)
    return PackedTensor("int8", w.shape[1], data.contiguous())


def pack_bf16(weight: torch.Tensor) -> PackedTensor:
    """A dense ``[out_features, in_features]`` weight stored in bf16 rows."""
    rows = weight.detach().to(torch.bfloat16).contiguous()
    return PackedTensor("bf16", rows.shape[1], rows.view(torch.uint8))
