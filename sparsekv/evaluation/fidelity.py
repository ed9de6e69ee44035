"""Fidelity of a compressed KV cache to the full one: greedy agreement and KL
(docs/benchmarks.md, "Fidelity").

Protocol: decode the full cache's greedy continuation (64 tokens), then feed those same tokens
to the compressed run (teacher forcing) and keep both runs' logits at those positions.

* greedy agreement = fraction of positions where the compressed argmax equals the full cache's
  token;
* KL = mean over positions of ``KL(p_full || p_compressed)``, in nats.

Functions here take tensors only; running the engine is the caller's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sparsekv.evaluation.corpus import license_files, read_text, stdlib_sources


@dataclass(frozen=True)
class FidelityResult:
    """Fidelity of one compressed run against the full cache.

    Attributes:
        agreement: greedy agreement in ``[0, 1]``.
        kl: mean KL(p_full || p_compressed) over positions, in nats.
        num_positions: teacher-forced positions compared (64 by convention).
        first_divergence: first position where the compressed argmax differs, else ``None``.
    """

    agreement: float
    kl: float
    num_positions: int
    first_divergence: int | None


def _as_logits(logits: Any, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(logits)
    if tensor.dim() != 2 or tensor.shape[0] == 0:
        raise ValueError(
            f"{name} must be [num_positions > 0, vocab_size], got {tuple(tensor.shape)}"
        )
    return tensor


def _mismatches(reference_tokens: Any, compressed_logits: Any) -> torch.Tensor:
    """Boolean ``[T]``: where the compressed argmax differs from the reference token."""
    logits = _as_logits(compressed_logits, "compressed_logits")
    tokens = torch.as_tensor(reference_tokens).reshape(-1).to(torch.long)
    if tokens.shape[0] != logits.shape[0]:
        raise ValueError(
            f"reference_tokens has {tokens.shape[0]} positions, logits {logits.shape[0]}"
        )
    return logits.argmax(dim=-1).cpu() != tokens.cpu()


def greedy_agreement(reference_tokens: Any, compressed_logits: Any) -> float:
    """Fraction of positions where ``argmax(compressed_logits)`` equals the reference token.

    Args:
        reference_tokens: ``[T]`` int token ids, the full cache's greedy continuation.
        compressed_logits: ``[T, V]`` logits of the compressed run at those positions
            (teacher-forced), any float dtype.

    Returns:
        Agreement in ``[0, 1]``.

    Raises:
        ValueError: empty input or mismatched lengths.
    """
    mismatches = _mismatches(reference_tokens, compressed_logits)
    return 1.0 - mismatches.double().mean().item()


def kl_per_position(full_logits: Any, compressed_logits: Any) -> torch.Tensor:
    """``KL(p_full || p_compressed)`` at each position, in nats, computed in float64.

    ``p = softmax(logits)`` per row via ``log_softmax``, so large logits never overflow; terms
    where ``p_full == 0`` (``-inf`` logits) contribute 0.

    Args:
        full_logits: ``[T, V]`` logits of the full-cache run.
        compressed_logits: ``[T, V]`` logits of the compressed run at the same positions.

    Returns:
        ``[T]`` float64 tensor, each entry >= 0.

    Raises:
        ValueError: shapes differ or are not ``[T > 0, V]``.
    """
    full = _as_logits(full_logits, "full_logits").to(torch.float64).cpu()
    comp = _as_logits(compressed_logits, "compressed_logits").to(torch.float64).cpu()
    if full.shape != comp.shape:
        raise ValueError(f"logit shapes differ: {tuple(full.shape)} vs {tuple(comp.shape)}")
    log_p = torch.log_softmax(full, dim=-1)
    log_q = torch.log_softmax(comp, dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    # Rounding can leave -1e-17 where the distributions are equal; KL is never negative.
    return terms.sum(dim=-1).clamp_min(0.0)


def mean_kl(full_logits: Any, compressed_logits: Any) -> float:
    """Mean over positions of ``KL(p_full || p_compressed)``, in nats (see
    :func:`kl_per_position` for shapes and errors)."""
    return kl_per_position(full_logits, compressed_logits).mean().item()


def fidelity(reference_tokens: Any, full_logits: Any, compressed_logits: Any) -> FidelityResult:
    """Greedy agreement, mean KL and first divergence in one result.

    Args:
        reference_tokens: ``[T]`` the full cache's greedy tokens.
        full_logits: ``[T, V]`` full-cache logits at those positions.
        compressed_logits: ``[T, V]`` compressed-run logits, teacher-forced on the same tokens.
    """
    mismatches = _mismatches(reference_tokens, compressed_logits)
    where = torch.nonzero(mismatches).flatten()
    return FidelityResult(
        agreement=1.0 - mismatches.double().mean().item(),
        kl=mean_kl(full_logits, compressed_logits),
        num_positions=int(mismatches.shape[0]),
        first_divergence=int(where[0]) if where.numel() else None,
    )


def _truncate(tokenizer: Any, text: str, num_tokens: int) -> str | None:
    """The first ``num_tokens`` tokens of ``text`` decoded back, or ``None`` if it is shorter.

    A prefix of 8 characters per wanted token is encoded first (tokens average 3-4 characters
    in prose and code); the whole text only when that prefix falls short.
    """
    ids = tokenizer.encode(text[: 8 * num_tokens], add_special_tokens=False)
    if len(ids) < num_tokens and len(text) > 8 * num_tokens:
        ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        return None
    return tokenizer.decode(ids[:num_tokens])


def long_texts(
    tokenizer: Any, min_tokens: int = 3000, count: int = 20, *, num_tokens: int | None = None
) -> list[tuple[str, str]]:
    """Real long documents found on this machine, for fidelity runs; nothing is downloaded.

    Candidates alternate between license texts (prose: ``/usr/share/common-licenses``, the
    stdlib ``LICENSE.txt``) and public stdlib modules (code: ``<stdlib>/*.py`` not starting with
    ``_``), each list sorted by name. Documents shorter than ``num_tokens`` are skipped, the
    rest cut to ``num_tokens`` tokens.

    Args:
        tokenizer: Hugging Face tokenizer used to count and cut (no special tokens).
        min_tokens: shortest document kept, in tokens; also the default cut length.
        count: documents wanted; fewer come back if the machine has fewer.
        num_tokens: length of each returned text in tokens (re-encoding may differ by a
            token or two); defaults to ``min_tokens``.

    Returns:
        ``[(name, text)]`` with names such as ``license/GPL-3`` and ``stdlib/argparse.py``.

    Raises:
        ValueError: ``num_tokens < min_tokens`` or a non-positive size.
    """
    num_tokens = min_tokens if num_tokens is None else num_tokens
    if min_tokens <= 0 or count <= 0 or num_tokens < min_tokens:
        raise ValueError(
            f"need 0 < min_tokens <= num_tokens and count > 0, got min_tokens={min_tokens}, "
            f"num_tokens={num_tokens}, count={count}"
        )
    prose = [(f"license/{p.name}", p) for p in license_files()]
    code = [(f"stdlib/{p.name}", p) for p in stdlib_sources() if not p.name.startswith("_")]
    interleaved = [c for pair in zip(prose, code) for c in pair]
    rest = prose[len(code) :] + code[len(prose) :]
    picked: list[tuple[str, str]] = []
    for name, path in interleaved + rest:
        if len(picked) == count:
            break
        text = read_text(path)
        if len(text) < num_tokens:  # a token spans at least one character
            continue
        cut = _truncate(tokenizer, text, num_tokens)
        if cut is not None:
            picked.append((name, cut))
    return picked
