"""llama.cpp's ``llama-bench`` as the other side of ``sparsekv bench decode-compare``.

``llama-bench -m GGUF -t T -p 0 -n N -d D -o json`` times N generated tokens after a D-token
context (no prompt-processing test), ``-r`` times over, and prints one JSON record per test with
``avg_ts`` / ``stddev_ts`` (tokens/s) and the cache types (``type_k`` / ``type_v``). The bytes
one of its decode steps reads are taken from the GGUF file itself: every tensor but the token
embedding (gathered one row per token) unless the file has no ``output.weight`` (a tied head,
then the embedding is the head's matrix), plus the K/V cache at the step's context.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Bytes per K/V element of llama.cpp's cache types (``-ctk`` / ``-ctv``; ``f16`` by default).
# Quantized types are blocks of 32 values: q8_0 = 34 bytes, q4_0 = 18, q4_1 = 20, q5_0 = 22,
# q5_1 = 24 per block (ggml's block layouts).
CACHE_TYPE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
}


@dataclass(frozen=True)
class GGUFShape:
    """What a llama.cpp decode step reads, from a GGUF file.

    Attributes:
        weight_bytes: bytes of the tensors a decode step multiplies by (see the module doc).
        num_layers: ``block_count``.
        num_kv_heads: ``attention.head_count_kv``.
        head_dim: ``embedding_length / attention.head_count`` (or ``attention.key_length``).
    """

    weight_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def kv_bytes(self, context: float, cache_type: str = "f16") -> float:
        """Bytes of K and V over every layer for ``context`` cached tokens.

        Raises:
            ValueError: a cache type not in :data:`CACHE_TYPE_BYTES`.
        """
        if cache_type not in CACHE_TYPE_BYTES:
            raise ValueError(f"cache_type: unknown llama.cpp cache type {cache_type!r}")
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_token * CACHE_TYPE_BYTES[cache_type] * context


def gguf_shape(path: str | Path) -> GGUFShape:
    """Read a GGUF file's tensor sizes and attention shape (``gguf`` package).

    Raises:
        ValueError: the file lacks the architecture keys a decoder has.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    tied = "output.weight" not in sizes
    read = sum(n for name, n in sizes.items() if name != "token_embd.weight" or tied)
    try:
        heads = int(_field(reader, f"{arch}.attention.head_count"))
        kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
        hidden = int(_field(reader, f"{arch}.embedding_length"))
        head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
        layers = int(_field(reader, f"{arch}.block_count"))
    except KeyError as exc:
        raise ValueError(f"model: {path} has no {exc.args[0]} key") from None
    return GGUFShape(read, layers, kv_heads, head_dim)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise KeyError(key)
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode()
    return value[0]


def run_llama_bench(
    binary: str | Path,
    model: str | Path,
    threads: int,
    context: int,
    output_len: int,
    repeats: int,
    timeout: float = 1800.0,
) -> dict:
    """Run ``llama-bench`` for batch-1 decode after ``context`` tokens and return its record.

    Args:
        binary: the ``llama-bench`` executable (``scripts/build_llama_bench.sh`` prints it).
        model: the GGUF file.
        threads: ``-t``.
        context: ``-d``, tokens already in the cache when the timed generation starts.
        output_len: ``-n``, tokens generated per repetition.
        repeats: ``-r``.
        timeout: seconds before the run is killed.

    Returns:
        The JSON record of the generation test (``avg_ts``, ``stddev_ts``, ``samples_ts``,
        ``type_k``, ``type_v``, ``cpu_info``, ``build_commit`` ...) plus ``command``.

    Raises:
        FileNotFoundError: ``binary`` does not exist.
        RuntimeError: llama-bench failed or printed no generation record.
    """
    binary = Path(binary)
    if not binary.is_file():
        raise FileNotFoundError(f"llama_bench: {binary} does not exist")
    command = [str(binary), "-m", str(model), "-t", str(threads), "-p", "0"]
    command += ["-n", str(output_len), "-d", str(context), "-r", str(repeats), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited {done.returncode}: {done.stderr[-2000:]}")
    records = [r for r in json.loads(done.stdout) if int(r.get("n_gen", 0)) > 0]
    if not records:
        raise RuntimeError(f"llama-bench printed no generation record: {done.stdout[-2000:]}")
    return records[0] | {"command": " ".join(command)}
