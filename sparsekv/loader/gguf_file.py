"""A small, fast reader for the GGUF container: header, metadata and tensor index.

``gguf.GGUFReader`` builds a numpy view for every metadata item; on tokenizer-heavy files
(49k-262k vocabulary strings) that takes 6-35 s on a small CPU. This reader walks the same
layout with ``struct`` and returns raw tensor bytes as zero-copy views of a memory map, which
``gguf.quants.dequantize`` then turns into float32. Spec:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, little-endian).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES = {kind: np.dtype(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class UnreadStrings:
    """Placeholder for a metadata array of strings that was skipped, not decoded.

    Attributes:
        count: number of strings.
        offset: byte offset of the first string's length prefix.
    """

    count: int
    offset: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file.

    Attributes:
        name: GGUF tensor name, e.g. ``blk.0.attn_q.weight``.
        shape: logical shape in PyTorch order (outermost first), i.e. GGUF's ``ne`` reversed;
            a linear weight is ``[out_features, in_features]``.
        qtype: ggml storage type (F32, Q4_K, ...).
        offset: absolute byte offset of the tensor data in the file.
        num_bytes: size of the stored (possibly quantized) data in bytes.
    """

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int
    num_bytes: int

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """Shape of the raw ``uint8`` data: rows as in ``shape``, last dim in bytes."""
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block_size * type_size)


@dataclass
class GGUFFile:
    """Parsed GGUF file: metadata key/values and a name -> tensor index (file order).

    Metadata values are Python scalars and strings, numpy arrays for numeric arrays, and
    :class:`UnreadStrings` for string arrays (the vocabulary; decode with :meth:`strings`).
    Tensor data is not read until :meth:`raw_data` is called.
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    _data: np.ndarray  # uint8 view of the whole file's read-only memory map

    @property
    def architecture(self) -> str:
        """``general.architecture`` (e.g. ``llama``, ``gemma3``)."""
        return str(self.metadata.get("general.architecture", ""))

    def strings(self, key: str) -> list[str]:
        """Decode a string-array metadata value, e.g. ``tokenizer.ggml.tokens``."""
        unread = self.metadata[key]
        buf, pos = self._data.data, unread.offset
        values = []
        for _ in range(unread.count):
            (length,) = _U64.unpack_from(buf, pos)
            values.append(bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8", errors="replace"))
            pos += 8 + length
        return values

    def raw_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """Zero-copy, read-only ``uint8`` view of a tensor's stored bytes, shape ``byte_shape``."""
        return self._data[info.offset : info.offset + info.num_bytes].reshape(info.byte_shape)


class _Cursor:
    """Sequential little-endian decoder over a bytes-like buffer."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> ValueError:
        return ValueError(
            f"model: {self.path} is not a valid GGUF file ({what} at byte {self.pos})"
        )

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as exc:
            raise self.fail("truncated") from exc
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise self.fail(f"string of {length} bytes runs past the end")
        value = self.buf[self.pos : end].decode("utf-8", errors="replace")
        self.pos = end
        return value

    def value(self, kind: int) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            return self.array()
        if kind not in _SCALAR_FORMATS:
            raise self.fail(f"unknown metadata type {kind}")
        return self.unpack(_SCALAR_FORMATS[GGUFValueType(kind)])

    def array(self) -> Any:
        kind = self.unpack("<I")
        count = self.unpack("<Q")
        if kind in _NUMPY_DTYPES:
            dtype = _NUMPY_DTYPES[GGUFValueType(kind)]
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise self.fail(f"array of {count} items runs past the end")
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos = end
            return values
        if count > len(self.buf):
            raise self.fail(f"array of {count} items is larger than the file")
        if kind == GGUFValueType.STRING:
            return self.skip_strings(count)
        return [self.value(kind) for _ in range(count)]

    def skip_strings(self, count: int) -> UnreadStrings:
        # Vocabularies hold up to ~262k strings; decoding them costs seconds and only the
        # tokenizer (built by transformers) needs them, so just walk past their lengths.
        buf, pos = self.buf, self.pos
        start = pos
        unpack_length = _U64.unpack_from
        try:
            for _ in range(count):
                pos += 8 + unpack_length(buf, pos)[0]
        except struct.error as exc:
            raise self.fail("truncated string array") from exc
        if pos > len(buf):
            raise self.fail("string array runs past the end")
        self.pos = pos
        return UnreadStrings(count=count, offset=start)


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor index (tensor data stays on disk).

    Args:
        path: a ``.gguf`` file.

    Returns:
        A :class:`GGUFFile` whose tensors can be read with :meth:`GGUFFile.raw_data`.

    Raises:
        ValueError: (message starts with ``model:``) the file is missing, is not GGUF, uses an
            unsupported version or tensor type, or is truncated.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"model: GGUF file {path} does not exist")
    if path.stat().st_size < 24:
        raise ValueError(
            f"model: {path} is not a valid GGUF file (only {path.stat().st_size} bytes)"
        )
    with path.open("rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mapping, dtype=np.uint8)
    cursor = _Cursor(mapping, path)
    if mapping[:4] != GGUF_MAGIC:
        raise ValueError(f"model: {path} is not a GGUF file (bad magic {mapping[:4]!r})")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in SUPPORTED_VERSIONS:
        raise cursor.fail(f"unsupported GGUF version {version}")
    num_tensors = cursor.unpack("<Q")
    num_kv = cursor.unpack("<Q")
    metadata = {}
    for _ in range(num_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    infos = [_read_tensor_info(cursor) for _ in range(num_tensors)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, shape, qtype, rel_offset in infos:
        info = _tensor_info(path, name, shape, qtype, data_start + rel_offset)
        if info.offset + info.num_bytes > len(data):
            raise ValueError(f"model: {path} is truncated (tensor {name} runs past the end)")
        tensors[name] = info
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors, _data=data)


def _read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    num_dims = cursor.unpack("<I")
    if num_dims > 8:
        raise cursor.fail(f"tensor {name} has {num_dims} dimensions")
    dims = tuple(cursor.unpack("<Q") for _ in range(num_dims))
    qtype = cursor.unpack("<I")
    offset = cursor.unpack("<Q")
    return name, tuple(reversed(dims)), qtype, offset


def _tensor_info(
    path: Path, name: str, shape: tuple[int, ...], qtype: int, offset: int
) -> GGUFTensorInfo:
    try:
        kind = GGMLQuantizationType(qtype)
        block_size, type_size = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError) as exc:
        raise ValueError(f"model: {path}: tensor {name} has unknown ggml type {qtype}") from exc
    if not shape or shape[-1] % block_size:
        raise ValueError(f"model: {path}: tensor {name} shape {shape} does not fit {kind.name}")
    num_rows = int(np.prod(shape[:-1], dtype=np.int64))
    num_bytes = num_rows * (shape[-1] // block_size) * type_size
    return GGUFTensorInfo(name=name, shape=shape, qtype=kind, offset=offset, num_bytes=num_bytes)
