"""SchedulerOutput -> forward -> sample -> RunnerOutput.

The runner flattens the step's tokens into one ragged batch (absolute positions: a token's
position is its index in the request, whatever was evicted), builds the attention metadata,
runs the model once, computes logits only for rows that sample, and samples them. With a
static decode path (``use_static_decode``; on CUDA the engine's default, captured as CUDA
graphs) the decode-only steps it takes run there instead of through the metadata build.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.engine.request import Request
from sparsekv.engine.scheduler_output import SchedulerOutput
from sparsekv.kv_cache.manager import KVCacheManager, LayerStep
from sparsekv.outputs import Logprob
from sparsekv.runner.kernel_scope import step_kernels
from sparsekv.runner.layer_scores import last_reconstruction_layer
from sparsekv.runner.metadata import BlockTableCache, RequestSlice, build_metadata
from sparsekv.runner.paged_attention import PagedAttention
from sparsekv.runner.prompt_logprobs import prompt_logprob_rows, prompt_logprobs
from sparsekv.runner.static_decode import StaticDecodeRunner
from sparsekv.sampling.sampler import Sampler, SamplingBatch
from sparsekv.spec_decode import rollback, self_draft, verify


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
    verified: dict[str, VerifiedTokens] = field(default_factory=dict)


@dataclass
class VerifiedTokens:
    """What a request that carried draft tokens emits (instead of a ``token_ids`` entry).

    Attributes:
        token_ids: the accepted drafts, then the target's own token (1 .. k + 1 ids).
        num_drafts: draft tokens the request carried (k).
        logprobs: one record per emitted token, or ``None`` when not requested.
    """

    token_ids: list[int]
    num_drafts: int
    logprobs: list[Logprob] | None = None


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
        # The decode path's tables between steps (persistent device tensors off CPU).
        self._block_tables = BlockTableCache(device)
        self.static_decode: StaticDecodeRunner | None = None

    def use_static_decode(self, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """Run the decode-only steps it takes on a ``StaticDecodeRunner`` from now on.

        Args:
            max_num_seqs: the largest batch bucket.
            max_model_len: longest request in tokens (the static table width).
            capture: capture each bucket as a CUDA graph (CUDA only); off: the static
                tensors, run eagerly.
        """
        self.static_decode = StaticDecodeRunner(
            self.model,
            self.kv,
            self.device,
            self.backend,
            max_num_seqs,
            max_model_len,
            capture=capture,
            logit_softcap=self.logit_softcap,
            rope_frequencies=self.rope_frequencies,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step.

        Raises:
            Whatever the model raises; the engine fails only this step's requests.
        """
        result = RunnerOutput()
        if out.is_empty:
            return result
        out.draft_seconds += self_draft.fill_self_drafts(
            self.model, self.kv, out.scheduled, self.device, self.logit_softcap
        )
        input_ids, positions, slices = [], [], []
        side_states = {}
        start = 0
        for item in out.scheduled:
            request = item.request
            first = request.num_computed_tokens
            num_known = item.num_new_tokens - len(item.draft_token_ids)
            end = first + item.num_new_tokens
            input_ids.extend(request.token_slice(first, first + num_known))
            input_ids.extend(item.draft_token_ids)
            positions.extend(range(first, end))
            segments, until = reconstruction_segments(request, item.layers, end)
            for segment in segments:  # each one placed right after the cached tokens
                input_ids.extend(segment)
                positions.extend(range(end, end + len(segment)))
            policy = request.policy
            request_slice = RequestSlice(
                request_id=request.request_id,
                start=start,
                num_new=item.num_new_tokens,
                layers=item.layers,
                kv=self.kv.get(request.request_id),
                compressor=policy.compressor if policy is not None else None,
                window=policy.window if policy is not None else 1,
                generator=request.kv_generator,
                segments=tuple(map(len, segments)),
                reconstruction_until=until,
            )
            if item.draft_token_ids:
                side_states[request.request_id] = rollback.side_state(request_slice.kv)
                if request_slice.needs_attention_mass:
                    request_slice.draft_mass = {}
            slices.append(request_slice)
            start += request_slice.num_rows
        sampling = [(s, item) for s, item in zip(slices, out.scheduled) if item.samples]
        static = self.static_decode
        if static is not None and len(sampling) == len(slices) and static.takes(slices):
            logits = static.run(slices, input_ids, positions)  # every row samples
        else:
            hidden = self._forward(slices, input_ids, positions)
            self._prompt_logprobs(out, slices, hidden, result)
            if not sampling:
                return result
            verifying = [(s, item) for s, item in sampling if item.draft_token_ids]
            if verifying:
                sampling = [(s, item) for s, item in sampling if not item.draft_token_ids]
                self._verify(verifying, hidden, side_states, result)
                if not sampling:
                    return result
            rows = [s.start + s.num_new - 1 for s, _ in sampling]
            rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden[rows_t])
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

    def _forward(
        self, slices: list[RequestSlice], input_ids: list[int], positions: list[int]
    ) -> torch.Tensor:
        """The eager forward of a step: ``[num_rows, hidden]`` final hidden states, the rows
        of every request's new tokens (reconstruction rows leave the forward early,
        ``runner.row_exit``) at each slice's ``start``."""
        metadata = build_metadata(
            slices, len(self.layer_specs), self.kv.block_size, self.device, self._block_tables
        )
        storages = [self.kv.storage(layer) for layer in range(len(self.layer_specs))]
        rebuild = None
        if any(s.segments for s in slices):  # reconstruction rows leave the forward early
            rebuild = functools.partial(
                build_metadata,
                num_layers=len(self.layer_specs),
                block_size=self.kv.block_size,
                device=self.device,
            )
        ctx = PagedAttention(
            storages,
            metadata,
            self.layer_specs,
            self.backend,
            self.logit_softcap,
            self.rope_frequencies,
            rebuild=rebuild,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        with step_kernels(self.backend):
            hidden = self.model(ids, pos, ctx)
            ctx.finish()
        return hidden

    def _verify(self, verifying, hidden, side_states, result: RunnerOutput) -> None:
        """Verify each drafting request's ``k + 1`` rows, then roll its rejected positions
        back (``spec_decode``): the step's ``num_new_tokens`` and every layer's ``num_new``
        become the kept positions before the scheduler commits the step."""
        rows = torch.tensor(
            [row for s, _ in verifying for row in range(s.start, s.start + s.num_new)],
            dtype=torch.long,
            device=self.device,
        )
        logits = self.model.compute_logits(hidden[rows])
        offset = 0
        for s, item in verifying:
            request, drafts = item.request, item.draft_token_ids
            emitted, record = verify.verify_request(
                logits[offset : offset + s.num_new], request, drafts
            )
            offset += s.num_new
            records = None
            if record is not None:
                num_top = request.sampling_params.logprobs
                records = [_logprob_record(record, i, num_top) for i in range(len(emitted))]
            result.verified[request.request_id] = VerifiedTokens(emitted, len(drafts), records)
            num_kept = len(emitted)
            rollback.roll_back(
                s.kv, item.layers, side_states[request.request_id], num_kept, s.window,
                s.draft_mass,
            )  # fmt: skip
            item.num_new_tokens = num_kept

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


def reconstruction_segments(
    request: Request, layers: list[LayerStep], end: int
) -> tuple[list[list[int]], int | None]:
    """The reconstruction segments a step appends for ``request`` (KVzip), and the last layer
    that reads them: at a prefill step where some layer scores its slots to compress them, the
    compressor's segments (token ids) over the tokens ``0 .. end - 1`` the cache holds after
    the step and ``last_reconstruction_layer``; ``([], None)`` otherwise."""
    policy = request.policy
    if policy is None or not policy.reconstructs:
        return [], None
    until = last_reconstruction_layer(policy.compressor, layers)
    if until is None:
        return [], None
    return policy.compressor.reconstruction_segments(request.token_slice(0, end)), until


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
