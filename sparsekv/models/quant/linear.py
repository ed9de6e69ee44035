"""A linear layer whose weight stays packed (GGUF blocks, int8 per channel, bf16 rows).

:class:`QuantizedLinear` replaces an ``nn.Linear`` of the decoder; its weight may be the row
concatenation of several packed parts (the fused QKV and gate/up projections of a GGUF file
whose q, k, v tensors were stored separately, possibly in different formats). Decode-sized
inputs run the native kernels on the packed bytes; prefill-sized ones dequantize tiles for a
dense matmul (``ops``), or with ``int8_rows`` (``--weight-dtype w8a8``) quantize the rows of
``x`` to int8 for an int8 GEMM (decode-sized ones too, on the CPUs where that is faster).

Adjacent parts of one format are stored as row slices of one tensor and multiplied by one
kernel call (a fused QKV of three Q4_1 tensors is one call, not three): every output row is
the same dot product either way (the kernels compute rows independently), so results are
unchanged. The arguments of those calls are built once, not per forward (a decode step runs
~120 of these layers, each in a few microseconds of kernel time).
"""

from __future__ import annotations

import torch
from torch import nn

from sparsekv.models.quant import int8_rows, ops
from sparsekv.models.quant.formats import FORMATS, PackedTensor

# Widths of leading-row views a layer keeps (``QuantizedLinear.leading_rows``): requests choose
# their draft vocabulary, so the count is bounded.
LEADING_ROWS_CACHED = 4


def _check_codes_fit_the_gemm(weight: PackedTensor) -> None:
    """Raise ``ValueError`` where the int8 GEMM saturates and ``weight`` (``int8``) has codes
    beyond its exact range (:data:`int8_rows.SATURATING_GEMM_CODE_MAX` + 1)."""
    if not int8_rows.int8_gemm_saturates():
        return
    top = int(weight.data[:, 4:].view(torch.int8).abs().max()) if weight.data.numel() else 0
    if top > int8_rows.SATURATING_GEMM_CODE_MAX + 1:
        raise ValueError(
            f"int8_rows: weight codes reach {top}, but this CPU's int8 GEMM is exact only up "
            f"to 64; quantize with quantize_int8(weight, code_max="
            f"{int8_rows.SATURATING_GEMM_CODE_MAX})"
        )


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` kept packed (inference only).

    Args:
        parts: the weight's row blocks, in output-feature order, all with the same
            ``in_features``.
        bias: ``[out_features]`` or ``None``; kept in fp32 (exact for a bf16 bias), the dtype
            the kernel op adds it in.
        int8_rows: multiply more rows than the kernels take with int8 activations
            (``--weight-dtype w8a8``); needs a single ``int8`` part.

    Raises:
        ValueError: no parts, parts of different ``in_features``, ``int8_rows`` on parts
            that are not one ``int8`` weight, or on weight codes the int8 GEMM would not
            multiply exactly (``int8_rows.int8_gemm_saturates``).

    ``forward``: ``x`` ``[..., in_features]`` fp32 or bf16 -> ``[..., out_features]`` in ``x``'s
    dtype. Up to ``ops.kernel_max_rows`` rows accumulate in fp32 on the packed weight, add the
    bias in fp32 and round once to ``x``'s dtype inside the kernel op (bf16 ``x`` is quantized to
    int8 per block of 32 by the ``avx512_amx`` and ``avx512_vnni`` kernels of Q4_0 / Q4_1 /
    Q8_0 and the x16 layouts' kernels of ``avx512_amx``, ``avx512_vnni`` and ``avx2``, read as
    it is by the ``avx512_bf16`` ones; other formats and variants convert it to fp32 inside the
    op); more rows multiply densely in ``x``'s dtype. With ``int8_rows`` on an ``int8`` weight
    where the variant has that path (``int8_rows.int8_rows_runs``), those rows, and decode-sized
    counts where it is the faster route (``int8_rows.takes_decode_rows``: from 2 rows on
    ``avx512_vnni`` and ``avx2``; more on an output head), are quantized to int8 as well
    (``int8_rows.int8_rows_matmul``: W8A8 with a scale per row).
    """

    def __init__(
        self, parts: list[PackedTensor], bias: torch.Tensor | None = None, int8_rows: bool = False
    ) -> None:
        super().__init__()
        if not parts or any(p.in_features != parts[0].in_features for p in parts):
            raise ValueError("weight: packed parts must share in_features")
        if int8_rows and [p.format for p in parts] != ["int8"]:
            raise ValueError("int8_rows: needs one int8 part")
        if int8_rows:
            _check_codes_fit_the_gemm(parts[0])
        self.int8_rows = int8_rows
        self.in_features = parts[0].in_features
        self.out_features = sum(p.shape[0] for p in parts)
        self.max_kernel_rows = ops.kernel_max_rows(
            self.out_features, self.in_features, ops.is_x16(parts)
        )
        self.large_weight = 2 * self.out_features * self.in_features > ops.LARGE_DENSE_BYTES
        self.formats = tuple(p.format for p in parts)
        # (kernel calls, fp32 bias) of a decode-sized forward, built on first use.
        self._calls: tuple[tuple[ops.KernelPart, ...], torch.Tensor | None] | None = None
        for i, data in enumerate(_adjacent_rows(parts)):
            self.register_buffer(f"packed_{i}", data)
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

    def kernel_calls(self) -> tuple[tuple[ops.KernelPart, ...], torch.Tensor | None]:
        """The native calls of a decode-sized forward (``ops.kernel_parts``; adjacent parts of
        one format that share a tensor merged into one) and the bias in fp32 (``None`` without
        one); built on first use and again after the buffers change (``to()``, assignment)."""
        if self._calls is None:
            calls: list[ops.KernelPart] = []
            for data, code, k, n in ops.kernel_parts(self.parts):
                if calls and _follows(calls[-1], data, code):
                    first, _, _, rows = calls[-1]
                    width = first.shape[1]  # packed rows: weight rows, or groups of 16 (x16)
                    span = first.as_strided((first.shape[0] + data.shape[0], width), (width, 1))
                    calls[-1] = (span, code, k, rows + n)
                else:
                    calls.append((data, code, k, n))
            bias = self.bias
            self._calls = (tuple(calls), None if bias is None else bias.to(torch.float32))
        return self._calls

    def leading_rows(self, num_rows: int) -> QuantizedLinear:
        """The layer restricted to its first ``num_rows`` outputs (``W[:num_rows]`` and the
        bias's first ``num_rows``) over views of this layer's packed bytes and bias: nothing is
        copied, and in-place updates of this layer reach it. Built once per ``num_rows`` (the
        last :data:`LEADING_ROWS_CACHED` widths are kept) and dropped when the buffers change;
        it is not a submodule (its bytes are this layer's).

        Raises:
            ValueError: ``num_rows`` is not in ``[1, out_features]``, or cuts an x16 group of
                16 rows.
        """
        cache = self.__dict__.setdefault("_leading", {})
        if num_rows in cache:
            return cache[num_rows]
        if not 1 <= num_rows <= self.out_features:
            raise ValueError(f"num_rows: must be in [1, {self.out_features}], got {num_rows}")
        parts: list[PackedTensor] = []
        left = num_rows
        for part in self.parts:
            group = FORMATS[part.format].group_rows
            if left % group and left < part.shape[0]:
                raise ValueError(
                    f"num_rows: {num_rows} cuts a group of {group} rows of {part.format}"
                )
            take = min(left, part.shape[0])
            data = part.data[: take // group]
            previous = parts[-1] if parts else None
            if previous is not None and previous.format == part.format:
                # adjacent parts of one format share a tensor here: one view spans both
                first = previous.data
                rows = first.shape[0] + data.shape[0]
                data = first.as_strided((rows, first.shape[1]), first.stride())
                parts[-1] = previous.with_rows(data)
            else:
                parts.append(part.with_rows(data))
            left -= take
            if left == 0:
                break
        sub = QuantizedLinear(parts, int8_rows=self.int8_rows)
        if self.bias is not None:
            sub.bias = self.bias[:num_rows]  # fp32 already: a view
        if len(cache) >= LEADING_ROWS_CACHED:
            del cache[next(iter(cache))]
        cache[num_rows] = sub
        return sub

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the decoder's [num_tokens, features]: no reshapes (~1 us each)
        rows = x if flat else x.reshape(-1, self.in_features)
        if self._takes_int8_rows(rows):
            _, bias32 = self._calls or self.kernel_calls()
            y = int8_rows.int8_rows_matmul(rows, self.parts[0], bias32)
        elif rows.shape[0] <= self.max_kernel_rows:
            calls, bias32 = self._calls or self.kernel_calls()
            y = ops.matmul_kernel_parts(rows, calls, self.out_features, bias32)
        else:
            y = ops.dense_matmul(rows, self.parts)
            if self.bias is not None:
                y += self.bias.to(y.dtype)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def _takes_int8_rows(self, rows: torch.Tensor) -> bool:
        """Whether ``rows`` (2-D) go through the int8 path (``forward`` and ``gated_forward``):
        ``int8_rows``, a variant and dtype it runs on, and more rows than the kernels take or a
        decode-sized count it runs faster (``int8_rows.takes_decode_rows``)."""
        if not self.int8_rows or self.out_features < int8_rows.INT8_ROWS_MIN_OUTPUTS:
            return False
        variant = int8_rows.runs_on(rows)  # resolved once per call, not twice
        if variant is None:
            return False
        num_rows = rows.shape[0]
        return num_rows > self.max_kernel_rows or int8_rows.takes_decode_rows(
            num_rows, self.large_weight, variant
        )

    def gated_forward(self, x: torch.Tensor, activation: str) -> torch.Tensor | None:
        """``act(gate) * up`` of this fused gate / up projection's output, computed inside the
        int8 path's scaling pass (``int8_rows.int8_rows_matmul``), or ``None`` where ``forward``
        would not take that path (not ``int8_rows``, few rows, another variant or dtype, an
        activation it does not fuse): the caller then applies the activation itself.

        Args:
            x: ``[num_tokens, in_features]``.
            activation: ``silu`` or ``gelu_tanh`` (``int8_rows.INT8_ROWS_ACTIVATIONS``).

        Returns:
            ``[num_tokens, out_features / 2]`` in ``x``'s dtype, or ``None``.
        """
        if (
            not self.int8_rows
            or self._forward_hooks
            or self._forward_pre_hooks
            or x.dim() != 2
            or activation not in int8_rows.INT8_ROWS_ACTIVATIONS
            or not self._takes_int8_rows(x)
        ):
            return None
        _, bias32 = self._calls or self.kernel_calls()
        return int8_rows.int8_rows_matmul(x, self.parts[0], bias32, activation)

    def _apply(self, fn, recurse=True):
        # Buffers may be replaced (moved, converted): the prepared calls would hold the old ones.
        self._calls = None
        self.__dict__.pop("_leading", None)
        return super()._apply(fn, recurse)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("packed_") or name == "bias":
            self.__dict__["_calls"] = None
            self.__dict__.pop("_leading", None)
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"formats={'+'.join(self.formats)}, bias={self.bias is not None}"
            + (", int8_rows=True" if self.int8_rows else "")
        )


def _adjacent_rows(parts: list[PackedTensor]) -> list[torch.Tensor]:
    """Each part's rows, those of adjacent parts of one format copied into one tensor (each
    returned tensor a row slice of it) so that one kernel call reads them all."""
    out: list[torch.Tensor] = []
    start = 0
    while start < len(parts):
        end = start + 1
        while end < len(parts) and parts[end].format == parts[start].format:
            end += 1
        if end - start == 1:
            out.append(parts[start].data)
        else:
            merged = torch.cat([p.data for p in parts[start:end]])
            out += list(merged.split([p.data.shape[0] for p in parts[start:end]]))
        start = end
    return out


def _follows(call: ops.KernelPart, data: torch.Tensor, code: int) -> bool:
    """True when ``data`` holds the rows right after ``call``'s in the same tensor, in the same
    format: one kernel call may read both."""
    prev = call[0]
    return (
        code == call[1]
        and data.dtype == prev.dtype
        and data.device == prev.device
        and data.shape[1] == prev.shape[1]
        and data.is_contiguous()
        and prev.is_contiguous()
        and data.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
        and data.data_ptr() == prev.data_ptr() + prev.numel() * prev.element_size()
    )
