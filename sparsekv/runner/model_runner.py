"""SchedulerOutput -> forward -> sample -> RunnerOutput.

The runner flattens the step's tokens into one ragged batch (absolute positions: a token's
position is its index in the request, whatever was evicted), builds the attention metadata,
runs the model once, computes logits only for rows that sample, and samples them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.engine.request import Request
from sparsekv.engine.scheduler_output import SchedulerOutput
from sparsekv.kv_cache.manager import KVCacheManager, LayerStep
from sparsekv.models.fused import ops as fused
from sparsekv.outputs import Logprob
from sparsekv.runner.metadata import BlockTableCache, RequestSlice, build_metadata
from sparsekv.runner.paged_attention import PagedAttention
from sparsekv.runner.prompt_logprobs import prompt_logprob_rows, prompt_logprobs
from sparsekv.sampling.sampler import Sampler, SamplingBatch


@dataclass
class RunnerOutput:
    """Sampled tokens of the step.

    Attributes:
        token_ids: request id -> sampled token (only requests that sampled).
        logprobs: request id -> logprob record (only where logprobs were requested).
        logits: request id -> fp32 ``[vocab_size]`` logits (only where collected).
        prompt_logprobs: request id -> (position of the first predicted prompt token, one
            record per predicted token) for prefill chunks of requests that asked for them.
    """

    token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprob] = field(default_factory=dict)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[Logprob]]] = field(default_factory=dict)


class ModelRunner:
    """Runs the model over scheduled steps.

    Args:
        model: a model with ``forward(input_ids, positions, ctx)``, ``compute_logits`` and
            ``layer_specs()``.
        kv: the KV manager (page storage and per-request state).
        device: torch device of the model.
        backend: the engine's attention backend (``None``: the one the KV storages run on).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCacheManager,
        device: torch.device,
        backend: AttentionBackend | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.backend = backend if backend is not None else kv.storage(0).backend
        self.layer_specs = kv.layer_specs
        self.sampler = Sampler()
        self.logit_softcap = getattr(model, "attn_logit_softcap", None)
        frequencies = getattr(model, "rope_frequencies", None)
        self.rope_frequencies = frequencies() if frequencies is not None else None
        self._block_tables = BlockTableCache()  # the decode path's tables between steps

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step.

        Raises:
            Whatever the model raises; the engine fails only this step's requests.
        """
        result = RunnerOutput()
        if out.is_empty:
            return result
        input_ids, positions, slices = [], [], []
        start = 0
        for item in out.scheduled:
            request = item.request
            first = request.num_computed_tokens
            end = first + item.num_new_tokens
            input_ids.extend(request.token_slice(first, end))
            positions.extend(range(first, end))
            segments = reconstruction_segments(request, item.layers, end)
            for segment in segments:  # each one placed right after the cached tokens
                input_ids.extend(segment)
                positions.extend(range(end, end + len(segment)))
            policy = request.compression
            slices.append(
                RequestSlice(
                    request_id=request.request_id,
                    start=start,
                    num_new=item.num_new_tokens,
                    layers=item.layers,
                    kv=self.kv.get(request.request_id),
                    compressor=request.compressor,
                    window=policy.window if policy is not None else 1,
                    generator=request.kv_generator,
                    segments=tuple(map(len, segments)),
                )
            )
            start += slices[-1].num_rows
        metadata = build_metadata(
            slices, len(self.layer_specs), self.kv.block_size, self.device, self._block_tables
        )
        storages = [self.kv.storage(layer) for layer in range(len(self.layer_specs))]
        ctx = PagedAttention(
            storages,
            metadata,
            self.layer_specs,
            self.backend,
            self.logit_softcap,
            self.rope_frequencies,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        with fused.native_scope():  # the fused ops' checks once per step, not per call
            hidden = self.model(ids, pos, ctx)
            ctx.finish()
        self._prompt_logprobs(out, slices, hidden, result)
        sampling = [(s, item) for s, item in zip(slices, out.scheduled) if item.samples]
        if not sampling:
            return result
        rows = torch.tensor(
            [s.start + s.num_new - 1 for s, _ in sampling], dtype=torch.long, device=self.device
        )
        logits = self.model.compute_logits(hidden[rows])
        requests = [item.request for _, item in sampling]
        batch = SamplingBatch.from_requests(
            params=[r.sampling_params for r in requests],
            generators=[r.generator for r in requests],
            prompt_ids=[r.prompt_token_ids for r in requests],
            output_ids=[r.output_token_ids for r in requests],
            eos_token_ids=[list(r.eos_token_ids) for r in requests],
            device=logits.device,
        )
        sampled = self.sampler(logits, batch)
        token_ids = sampled.token_ids.tolist()
        for i, request in enumerate(requests):
            result.token_ids[request.request_id] = token_ids[i]
            if request.collect_logits:
                result.logits[request.request_id] = logits[i].cpu()
            if request.sampling_params.logprobs is not None and sampled.logprobs is not None:
                num_top = request.sampling_params.logprobs
                result.logprobs[request.request_id] = _logprob_record(sampled, i, num_top)
        return result

    def _prompt_logprobs(self, out: SchedulerOutput, slices, hidden, result) -> None:
        """Records for the prompt tokens this step's prefill rows predict (where asked)."""
        for s, item in zip(slices, out.scheduled):
            request = item.request
            num_top = request.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            first = request.num_computed_tokens
            rows = prompt_logprob_rows(first, s.num_new, request.num_prompt_tokens)
            if len(rows) == 0:
                continue
            targets = request.prompt_token_ids[first + 1 : first + 1 + len(rows)]
            block = hidden[s.start : s.start + len(rows)]
            records = prompt_logprobs(self.model, block, targets, num_top)
            result.prompt_logprobs[request.request_id] = (first + 1, records)


def reconstruction_segments(request: Request, layers: list[LayerStep], end: int) -> list[list[int]]:
    """Token ids of the reconstruction segments a step appends for ``request`` (KVzip): at
    a prefill step where some layer compresses, the compressor's segments over the tokens
    ``0 .. end - 1`` the cache holds after the step; none otherwise."""
    compressor = request.compressor
    if compressor is None or not compressor.reconstructs:
        return []
    if not any(s.compress_to is not None and not s.decode_compaction for s in layers):
        return []
    return compressor.reconstruction_segments(request.token_slice(0, end))


def _logprob_record(sampled, row: int, num_top: int) -> Logprob:
    top = []
    if sampled.top_ids is not None and num_top > 0:
        ids = sampled.top_ids[row, :num_top].tolist()
        top = list(zip(ids, sampled.top_logprobs[row, :num_top].tolist()))
    return Logprob(
        token_id=int(sampled.token_ids[row]),
        logprob=float(sampled.logprobs[row]),
        top=top,
    )
