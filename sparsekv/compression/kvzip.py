"""KVzip (Kim et al., arXiv 2505.23416): query-agnostic scores from context reconstruction.

A slot matters if the model needs it to repeat the context. After the prompt, the model reads
a reconstruction input, "Repeat the previous context exactly." followed by the chat template's
assistant header and the context tokens themselves, attending over the request's cache. The
score of held slot ``j`` for query head ``h`` is the largest softmax weight any reconstruction
row puts on it; a KV head ``g`` combines its group's query heads with the policy's ``gqa_agg``
(the paper takes the max, ``gqa_agg=max``; the default is the mean):

    ``score_g[j] = agg_{h in group g} max_i exp(q_hi . k_j * scale - lse_hi)``

with ``lse_hi`` the row's full log-sum-exp: over the held slots and the reconstruction rows
the row sees (its own segment, causally). The scores are then pooled along the slots with the
policy's ``pooling`` and ``kernel_size`` (max over 15 by default, as SnapKV's), and the first
``sinks`` slots always stay.

Long contexts are reconstructed in segments of ``chunk_size`` context tokens (each segment
placed right after the context, later ones prompted "Repeat the part of the previous context
exactly, starting with" and the previous chunk's last ``prev_tokens`` tokens), which bounds the
positions and the attention each segment costs; the scores are the max over every segment.

In the engine the reconstruction rows ride along in the forward of the prefill step that
compresses (``runner.model_runner``): each layer attends them over its uncompressed slots and
hands them to the compressor in ``LayerView.reconstruction``; their K/V are never written to
the pages. Without reconstruction rows (decode-time eviction) the score is the same max over
the stored observation-window queries.

Where this differs from kvpress's ``KVzipPress``: a row's softmax is over every slot it sees
(kvpress normalises over the sinks, the segment's chunk and the reconstruction rows only), and
every segment scores every held slot (kvpress scores a chunk's slots from its own segment);
the chat template's prefix tokens are scored like the others (kvpress scores only the sinks
among them); the budget is per layer, as every method here, not spread across layers; and the
scores are pooled (KVzip and kvpress do not pool: ``pooling="none"`` with ``gqa_agg="max"``
gives their scores). On
Gemma 3 270M, whose global layers share one KV head among four query heads, one of them a
copy head that puts most of its weight on the token it repeats, the unpooled scores keep
scattered digits of a needle in some layers; pooling keeps the spans. Its later global layers'
own scores still miss most needles, which its first global layer's scores keep: with
``layer_scores="first"`` every budgeted layer ranks by those (``runner.layer_scores``;
docs/compression.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsekv.compression.base import Compressor, LayerView
from sparsekv.compression.scoring import aggregate_gqa, pool_scores, window_attention_scores

FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
LATER_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass(frozen=True)
class RepeatPrompt:
    """Token ids that frame a reconstruction segment (built once per tokenizer).

    Attributes:
        first: the first segment's instruction.
        later: later segments' instruction (followed by the previous chunk's last tokens).
        suffix: what closes the instruction: the chat template's end of the user turn and
            assistant header, or a newline without a template.
        template_prefix: the chat template's tokens before a user message's content; a context
            that starts with them is reconstructed without them.
    """

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]
    template_prefix: tuple[int, ...] = ()


def repeat_prompt(tokenizer) -> RepeatPrompt:
    """The reconstruction framing of a transformers tokenizer (KVzip's instructions; the
    template's parts found by rendering a marked dummy message, as kvpress does)."""

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()

    prefix_text, suffix_text = "", "\n"
    if getattr(tokenizer, "chat_template", None):
        marker = "sparsekv context"
        separator = "\n" + "#" * len(marker)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker + separator}],
            add_generation_prompt=True,
            tokenize=False,
        )
        before, suffix_text = rendered.split(separator, 1)
        prefix_text = before.split(marker, 1)[0]
    return RepeatPrompt(
        first=encode(FIRST_INSTRUCTION),
        later=encode(LATER_INSTRUCTION),
        suffix=encode(suffix_text),
        template_prefix=encode(prefix_text),
    )


_REPEAT_PROMPTS: dict[int, tuple[object, RepeatPrompt]] = {}


def _cached_repeat_prompt(tokenizer) -> RepeatPrompt:
    """``repeat_prompt`` once per live tokenizer object."""
    entry = _REPEAT_PROMPTS.get(id(tokenizer))
    if entry is None or entry[0] is not tokenizer:
        entry = (tokenizer, repeat_prompt(tokenizer))
        _REPEAT_PROMPTS[id(tokenizer)] = entry
    return entry[1]


@dataclass
class KVzipCompressor(Compressor):
    """Max attention of the context-reconstruction rows (module docstring).

    Attributes:
        sinks: leading slots always kept (kvpress: 4).
        chunk_size: context tokens reconstructed per segment (kvpress: 2048).
        prev_tokens: tokens of the previous chunk that prompt a later segment (kvpress: 8).
        repeat: the tokenizer's framing (the engine sets it from its tokenizer); ``None``
            reconstructs the bare context tokens.
    """

    name = "kvzip"
    reconstructs = True

    sinks: int = 4
    chunk_size: int = 2048
    prev_tokens: int = 8
    repeat: RepeatPrompt | None = None

    def bind(self, tokenizer) -> None:
        """Frame the reconstruction with the tokenizer's chat template (built once per
        tokenizer)."""
        self.repeat = _cached_repeat_prompt(tokenizer)

    def reconstruction_segments(self, token_ids: Sequence[int]) -> list[list[int]]:
        """The reconstruction inputs of a context, one list of token ids per segment.

        Args:
            token_ids: the context as cached (the tokens of the held slots, in order).

        Returns:
            Segments of ``instruction + suffix + chunk``; empty for an empty context.
        """
        repeat = self.repeat or RepeatPrompt((), (), ())
        body = list(token_ids)
        prefix = list(repeat.template_prefix)
        if prefix and body[: len(prefix)] == prefix and len(body) > len(prefix):
            body = body[len(prefix) :]
        chunks = [body[i : i + self.chunk_size] for i in range(0, len(body), self.chunk_size)]
        segments = []
        for i, chunk in enumerate(chunks):
            if i == 0:
                head = list(repeat.first)
            else:
                head = list(repeat.later) + chunks[i - 1][-self.prev_tokens :]
            segments.append(head + list(repeat.suffix) + chunk)
        return segments

    def score(self, view: LayerView) -> torch.Tensor:
        """``[num_kv_heads, n]`` fp32, pooled; the first ``sinks`` slots score ``+inf``."""
        num_kv_heads, n = view.num_kv_heads, view.num_tokens
        if view.reconstruction:
            best = None
            for segment in view.reconstruction:
                keys = torch.cat([view.keys, segment.keys.to(view.keys.dtype)], dim=1)
                scores = self._max_attention(view, keys, segment.queries, segment.lse)[:, :n]
                best = scores if best is None else torch.maximum(best, scores)
        else:
            best = self._max_attention(view, view.keys, view.window_queries, view.window_lse)
        # Every slot is pooled, the observation window's too (unlike SnapKV, KVzip scores
        # them): at most ``kernel_size // 2`` slots just before the window inherit its scores.
        scores = pool_scores(
            aggregate_gqa(best, num_kv_heads, self.gqa_agg), self.pooling, self.kernel_size
        )
        scores[:, : min(self.sinks, n)] = float("inf")
        return scores

    @staticmethod
    def _max_attention(
        view: LayerView, keys: torch.Tensor, queries: torch.Tensor, lse: torch.Tensor | None
    ) -> torch.Tensor:
        """``[num_heads, keys.shape[1]]`` fp32 max softmax weight of the rows (the last
        ``queries.shape[1]`` positions of ``keys``) on each slot, chunked over rows."""
        return window_attention_scores(
            keys, queries, lse, view.scale, view.logit_softcap, view.backend, reduce="max"
        )
