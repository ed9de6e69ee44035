"""The static-buffer decode path: decode-only steps over fixed tensors, captured as CUDA graphs.

A decode-only step (one new token per request, every layer on the decode path) is padded to
the next batch bucket (1, 2, 4, 8, ... ``max_num_seqs``) and its inputs are copied into
tensors allocated once: token ids and positions ``[2, B]``, block tables ``[L, B, W]`` of a
fixed width ``W`` (pages of ``max_model_len`` plus one), slot counts ``[3, L, B]`` (the new
token's slot, the slot count after its write, the first slot). Padding rows read and write
one slot of a scratch page no request holds (``KVCacheManager.scratch_pages``). The forward
runs in a ``PagedAttention`` built once per bucket over views of those tensors: it takes no
branch that depends on the step, keeps no Python reference to a step tensor (every layer's
queries go into a static buffer) and calls nothing that syncs with the host. The forward's
side effects happen after it: the budgeted layers' queries are logged from the buffer and
decode-time compactions run eagerly (``PagedAttention.record_decode_step``).

On CUDA each bucket's forward (model and logits) is captured once as a ``torch.cuda.CUDAGraph``
and replayed; elsewhere, or with ``capture`` off, the same path runs eagerly over the same
tensors (what the CPU tests check against the eager path). Host inputs go through a mirror
(pinned on CUDA) with ``non_blocking`` copies; only block-table rows that changed are copied.

Steps the path does not take run eagerly (``StaticDecodeRunner.takes``): prefill chunks,
H2O (per-slot attention mass of a variable width), quantized pages (int8 / fp8 may
dequantize the referenced pages with a data-dependent ``unique``, int4 keeps residuals in
Python lists), more requests than the largest bucket, and tables wider than ``W``.
"""

from __future__ import annotations

import numpy as np
import torch

from sparsekv.attention.backends.base import AttentionBackend
from sparsekv.kv_cache.manager import KVCacheManager
from sparsekv.kv_cache.spec import cdiv
from sparsekv.runner.block_tables import HostFence, row_runs, slot_counts
from sparsekv.runner.kernel_scope import step_kernels
from sparsekv.runner.metadata import AttentionMetadata, DecodeBatch, RequestSlice
from sparsekv.runner.paged_attention import PagedAttention


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: powers of two below ``max_num_seqs``, then ``max_num_seqs``.

    Raises:
        ValueError: ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return buckets + [max_num_seqs]


class StaticDecodeRunner:
    """Runs eligible decode-only steps over static tensors (graph-captured on CUDA).

    Args:
        model: the engine's model (``forward``, ``compute_logits``, ``num_heads``,
            ``head_dim``).
        kv: the KV manager (storages, scratch pages).
        device: the model's device.
        backend: the engine's attention backend.
        max_num_seqs: the largest bucket.
        max_model_len: longest request in tokens (sets the table width).
        capture: capture CUDA graphs (needs a CUDA ``device``); off: run eagerly.
        logit_softcap, rope_frequencies: as ``PagedAttention`` takes them.

    Attributes:
        buckets: the padded batch sizes.
        width: block-table columns ``W``.
        rows_copied: block-table rows copied host to device so far.
        graphs: bucket -> captured graph (CUDA with ``capture`` only).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCacheManager,
        device: torch.device,
        backend: AttentionBackend,
        max_num_seqs: int,
        max_model_len: int,
        capture: bool = False,
        logit_softcap: float | None = None,
        rope_frequencies: list[torch.Tensor] | None = None,
    ) -> None:
        if capture and device.type != "cuda":
            raise ValueError(f"capture: CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv, self.device, self.capture = model, kv, device, capture
        self.buckets = batch_buckets(max_num_seqs)
        self.block_size = kv.block_size
        self.width = cdiv(max_model_len, self.block_size) + 1
        self.rows_copied = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        num_layers, most = kv.num_layers, self.buckets[-1]
        scratch = kv.scratch_pages()
        self._scratch = np.array([scratch[kind] for kind in kv.layer_kinds], dtype=np.int64)
        pin = device.type == "cuda"
        self._host_tokens = torch.zeros(2, most, dtype=torch.int64, pin_memory=pin)
        self._host_tables = torch.zeros(num_layers, most, self.width, dtype=torch.int64)
        self._host_tables = self._host_tables.pin_memory() if pin else self._host_tables
        self._host_tables.numpy()[:] = self._scratch[:, None, None]
        self._host_counts = torch.zeros(3, num_layers, most, dtype=torch.int64, pin_memory=pin)
        # The page list each host table row holds (None: a padding row of scratch pages).
        self._rows: list[list[list[int] | None]] = [[None] * most for _ in range(num_layers)]
        self._fence = HostFence()  # the last step's copies out of the host mirror
        self.tokens = torch.zeros(2, most, dtype=torch.int64, device=device)
        self.tables = self._host_tables.to(device, copy=True)
        self.counts = torch.zeros(3, num_layers, most, dtype=torch.int64, device=device)
        dtype = kv.storages[0].dtype
        shape = (num_layers, most, model.num_heads, model.head_dim)
        self.query_log = torch.zeros(shape, dtype=dtype, device=device)
        storages = [kv.storage(layer) for layer in range(num_layers)]
        self._contexts = {
            bucket: PagedAttention(
                storages,
                self._static_metadata(bucket),
                kv.layer_specs,
                backend,
                logit_softcap,
                rope_frequencies,
                query_buffer=self.query_log,
            )
            for bucket in self.buckets
        }
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def _static_metadata(self, bucket: int) -> AttentionMetadata:
        """Decode batches over the first ``bucket`` rows of the static tensors."""
        rows = torch.arange(bucket, device=self.device)
        decode: list[DecodeBatch | None] = [
            DecodeBatch(
                slices=[],
                rows=rows,
                slot_mapping=self.counts[0, layer, :bucket],
                block_tables=self.tables[layer, :bucket],
                seq_lens=self.counts[1, layer, :bucket],
                first_slots=self.counts[2, layer, :bucket],
                all_rows=True,
                need_mass=False,
                budgeted=False,
            )
            for layer in range(self.kv.num_layers)
        ]
        return AttentionMetadata([], decode, [[] for _ in decode], bucket)

    # ------------------------------------------------------------------ eligibility
    def takes(self, slices: list[RequestSlice]) -> bool:
        """Whether this step runs on the static path: decode only (one token per request,
        every layer on the decode path, none head-wise), no H2O, full-precision pages, at most the largest
        bucket, every table within ``width`` pages."""
        if not slices or len(slices) > self.buckets[-1]:
            return False
        if any(storage.kv_cache_dtype != "auto" for storage in self.kv.storages):
            return False
        for s in slices:
            if s.num_new != 1 or s.segments or s.needs_attention_mass:
                return False
            for step in s.layers:
                if step.compress_to is not None and not step.decode_compaction:
                    return False
                if step.head_lens is not None:
                    return False
                if len(step.block_table) > self.width or step.num_held >= self.width * (
                    self.block_size
                ):
                    return False
        return True

    # ------------------------------------------------------------------ one step
    def run(
        self, slices: list[RequestSlice], input_ids: list[int], positions: list[int]
    ) -> torch.Tensor:
        """Run one step ``takes`` accepted: inputs into the static tensors, the bucket's
        forward (replayed graph or eager), then the side effects.

        Args:
            slices: the step's requests in batch order (row ``i`` is ``slices[i]``).
            input_ids, positions: one token and its position per request.

        Returns:
            ``[len(slices), vocab_size]`` fp32 logits, a view of the bucket's output (valid
            until the next ``run``).
        """
        num_rows = len(slices)
        bucket = next(b for b in self.buckets if b >= num_rows)
        self._fill(slices, input_ids, positions, bucket)
        logits = self.forward(bucket)
        self._side_effects(slices, bucket)
        return logits[:num_rows]

    def forward(self, bucket: int) -> torch.Tensor:
        """The bucket's forward over the static tensors as they are: ``[bucket, vocab]``
        fp32 logits (the captured graph's output on CUDA with ``capture``)."""
        if not self.capture:
            with step_kernels(self._contexts[bucket].backend):
                return self._forward(bucket)
        if bucket not in self.graphs:
            self._capture(bucket)
        self.graphs[bucket].replay()
        return self._outputs[bucket]

    def _forward(self, bucket: int) -> torch.Tensor:
        ids, positions = self.tokens[0, :bucket], self.tokens[1, :bucket]
        hidden = self.model(ids, positions, self._contexts[bucket])
        return self.model.compute_logits(hidden)

    def _capture(self, bucket: int) -> None:
        """Warm the bucket up on a side stream (allocator and kernel caches), then capture
        its forward into the graph memory pool all buckets share."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[bucket] = self._forward(bucket)
        self.graphs[bucket] = graph

    def _fill(
        self, slices: list[RequestSlice], input_ids: list[int], positions: list[int], bucket: int
    ) -> None:
        """Write the step's inputs into the host mirror and copy them to the device: tokens
        and slot counts whole, block-table rows only where the page list changed."""
        num_rows, num_layers = len(slices), self.kv.num_layers
        self._fence.wait()
        tokens = self._host_tokens.numpy()
        tokens[0, :num_rows], tokens[1, :num_rows] = input_ids, positions
        tokens[:, num_rows:bucket] = 0
        tables = self._host_tables.numpy()
        held = np.zeros((num_layers, bucket), dtype=np.int64)
        first = np.zeros((num_layers, bucket), dtype=np.int64)
        changed: list[list[int]] = []
        for layer, rows in enumerate(self._rows):
            layer_changed = []
            for i in range(bucket):
                table = slices[i].layers[layer].block_table if i < num_rows else None
                if table != rows[i]:
                    tables[layer, i, : len(table or ())] = table or ()
                    tables[layer, i, len(table or ()) :] = self._scratch[layer]
                    rows[i] = None if table is None else list(table)
                    layer_changed.append(i)
                if table is not None:
                    step = slices[i].layers[layer]
                    held[layer, i], first[layer, i] = step.num_held, step.first_slot
            changed.append(layer_changed)
        counts = self._host_counts.numpy()[:, :, :bucket]
        flat = slot_counts(
            tables[:, :bucket].reshape(-1, self.width),
            held.reshape(-1),
            first.reshape(-1),
            self.block_size,
        )
        counts[:] = flat.reshape(3, num_layers, bucket)
        self.tokens.copy_(self._host_tokens, non_blocking=True)
        self.counts.copy_(self._host_counts, non_blocking=True)
        for layer, rows in enumerate(changed):
            for start, stop in row_runs(rows):
                source = self._host_tables[layer, start:stop]
                self.tables[layer, start:stop].copy_(source, non_blocking=True)
                self.rows_copied += stop - start
        self._fence.record(self.device)

    def _side_effects(self, slices: list[RequestSlice], bucket: int) -> None:
        """What the forward would have done in Python: log the budgeted layers' queries
        (copied out of the static buffer) and run the step's decode-time compactions."""
        context = self._contexts[bucket]
        num_layers, num_rows = self.kv.num_layers, len(slices)
        budgeted = [
            layer
            for layer in range(num_layers)
            if any(s.kv.layers[layer].budget is not None for s in slices)
        ]
        compacting = [
            (s, layer, context.decode_scales[layer])
            for layer in range(num_layers)
            for s in slices
            if s.layers[layer].decode_compaction
        ]
        if not budgeted and not compacting:
            return
        storages = context.storages
        metadata = AttentionMetadata(slices, [None] * num_layers, [], num_rows)
        step = PagedAttention(
            storages,
            metadata,
            self.kv.layer_specs,
            context.backend,
            context.logit_softcap,
            context.rope_frequencies,
        )
        queries = {layer: self.query_log[layer, :num_rows] for layer in budgeted}
        step.record_decode_step(slices, queries, compacting)
        step.finish()
