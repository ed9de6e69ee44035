"""``SamplingBatch``: one engine step's sampling settings as tensors, built once per step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsekv.sampling_params import SamplingParams

# Pads ragged token-id rows; the sampler maps it (and ids >= vocab size) to a dropped column.
PAD_TOKEN_ID = -1


@dataclass
class SamplingBatch:
    """Per-row sampling state of one step (row ``i`` = logits row ``i``).

    Tensors that no row needs are ``None``, so a step of plain greedy requests costs one argmax.
    ``R`` = number of sampled (non-greedy) rows, ``B`` = all rows.

    Attributes:
        num_rows: ``B``.
        greedy_rows: ``[G]`` int64, rows that take the argmax of the penalized logits.
        random_rows: ``[R]`` int64, rows that sample.
        temperature: ``[R]`` fp32, > 0.
        top_k: ``[R]`` int64 (``<= 0`` = off), or ``None`` when no sampled row uses it.
        top_p: ``[R]`` fp32 (``1`` = off), or ``None``.
        min_p: ``[R]`` fp32 (``0`` = off), or ``None``.
        generators: ``R`` entries: the row's own generator, or ``None`` to share the
            default generator's draw.
        repetition_penalty: ``[B]`` fp32, or ``None`` when every row has 1.
        seen_token_ids: ``[B, L]`` int64, prompt + output ids padded with ``PAD_TOKEN_ID``
            (only rows with a repetition penalty have ids), with ``repetition_penalty``.
        presence_penalty: ``[B]`` fp32, or ``None`` when no row has presence/frequency penalties.
        frequency_penalty: ``[B]`` fp32, with ``presence_penalty``.
        output_token_ids: ``[B, L]`` int64, generated ids padded with ``PAD_TOKEN_ID``, with
            ``presence_penalty``.
        banned_rows: ``[M]`` int64 and ``banned_token_ids`` ``[M]`` int64: (row, token) pairs
            masked to ``-inf`` because the row has not reached ``min_tokens`` yet; ``None``
            when empty.
        num_logprobs: the largest top-N any row asked for (0-20), or ``None`` when no row
            asked for logprobs.
    """

    num_rows: int
    greedy_rows: torch.Tensor
    random_rows: torch.Tensor
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    generators: list[torch.Generator | None] | None = None
    repetition_penalty: torch.Tensor | None = None
    seen_token_ids: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None
    num_logprobs: int | None = None

    @property
    def is_argmax_only(self) -> bool:
        """Every row is greedy with nothing to change its logits and no logprobs."""
        return (
            len(self.random_rows) == 0
            and self.repetition_penalty is None
            and self.presence_penalty is None
            and self.banned_rows is None
            and self.num_logprobs is None
        )

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        *,
        eos_token_ids: Sequence[int] | Sequence[Sequence[int]] = (),
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Builds the step's tensors; call once per step, rows in logits order.

        Args:
            params: each row's (validated) settings.
            generators: each row's own generator for seeded requests (any device: a CPU
                generator also serves CUDA logits), else ``None``. A sampled row consumes
                exactly ``V`` uniforms from it per step; greedy rows consume nothing.
            prompt_ids: each row's prompt ids (read only for repetition penalties).
            output_ids: each row's generated ids so far (penalties, ``min_tokens``).
            eos_token_ids: EOS ids, either one list for every row (the model's) or one list per
                row; masked with the row's ``stop_token_ids`` until it has ``min_tokens``
                outputs (EOS stays allowed when the row sets ``ignore_eos``).
            device: device of the step's logits (the sampler moves the batch there otherwise).

        Returns:
            The batch the ``Sampler`` consumes.
        """
        num_rows = len(params)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        random = [i for i, p in enumerate(params) if not p.is_greedy]
        batch = cls(
            num_rows=num_rows,
            greedy_rows=torch.tensor(greedy, dtype=torch.int64, device=device),
            random_rows=torch.tensor(random, dtype=torch.int64, device=device),
        )
        if random:
            batch._add_distribution([params[i] for i in random], device)
            batch.generators = [generators[i] for i in random]
        if any(p.repetition_penalty != 1.0 for p in params):
            batch._add_repetition(params, prompt_ids, output_ids, device)
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            batch._add_frequency(params, output_ids, device)
        batch._add_min_tokens(params, output_ids, _eos_per_row(eos_token_ids, num_rows), device)
        requested = [p.logprobs for p in params if p.logprobs is not None]
        batch.num_logprobs = max(requested) if requested else None
        return batch

    def _add_distribution(self, rows: list[SamplingParams], device) -> None:
        self.temperature = _floats([p.temperature for p in rows], device)
        if any(p.top_k > 0 for p in rows):
            self.top_k = torch.tensor([p.top_k for p in rows], dtype=torch.int64, device=device)
        if any(p.top_p < 1.0 for p in rows):
            self.top_p = _floats([p.top_p for p in rows], device)
        if any(p.min_p > 0.0 for p in rows):
            self.min_p = _floats([p.min_p for p in rows], device)

    def _add_repetition(self, params, prompt_ids, output_ids, device) -> None:
        self.repetition_penalty = _floats([p.repetition_penalty for p in params], device)
        seen = [
            [*prompt, *output] if p.repetition_penalty != 1.0 else []
            for p, prompt, output in zip(params, prompt_ids, output_ids)
        ]
        self.seen_token_ids = _pad(seen, device)

    def _add_frequency(self, params, output_ids, device) -> None:
        self.presence_penalty = _floats([p.presence_penalty for p in params], device)
        self.frequency_penalty = _floats([p.frequency_penalty for p in params], device)
        outputs = [
            output if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 else []
            for p, output in zip(params, output_ids)
        ]
        self.output_token_ids = _pad(outputs, device)

    def to(self, device: torch.device | str) -> SamplingBatch:
        """A copy with every tensor on ``device`` (generators stay where they are)."""
        moved = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return SamplingBatch(**moved)

    def _add_min_tokens(self, params, output_ids, eos_per_row, device) -> None:
        rows: list[int] = []
        tokens: list[int] = []
        for i, (p, output, eos) in enumerate(zip(params, output_ids, eos_per_row)):
            if len(output) >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(eos)
            rows.extend([i] * len(banned))
            tokens.extend(sorted(banned))
        if rows:
            self.banned_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            self.banned_token_ids = torch.tensor(tokens, dtype=torch.int64, device=device)


def _eos_per_row(
    eos_token_ids: Sequence[int] | Sequence[Sequence[int]], num_rows: int
) -> list[Sequence[int]]:
    """One EOS list per row, from a shared list or a list of lists."""
    if len(eos_token_ids) and not isinstance(eos_token_ids[0], int):
        if len(eos_token_ids) != num_rows:
            raise ValueError(f"eos_token_ids has {len(eos_token_ids)} rows, expected {num_rows}")
        return list(eos_token_ids)
    return [eos_token_ids] * num_rows


def _floats(values: list[float], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _pad(rows: list[Sequence[int]], device) -> torch.Tensor:
    """``[B, max_len]`` int64, short rows padded with ``PAD_TOKEN_ID``."""
    width = max(1, max(len(r) for r in rows))
    padded = [list(r) + [PAD_TOKEN_ID] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device)
