"""The logprobs of ``/v1/completions``: OpenAI's legacy object (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) and vLLM's ``prompt_logprobs`` list.

``text_offset`` is each token's first character in the choice's ``text`` (``TextOffsets``); a
token whose bytes are not UTF-8 text on their own (part of a character split over several
tokens) is written ``bytes:\\xNN...`` in ``tokens`` and as its ``top_logprobs`` key, as OpenAI's
legacy API writes such tokens, so alternatives that are different pieces of characters keep
distinct keys. With ``echo`` the prompt tokens come first, the first one with ``null`` logprob
and top logprobs (nothing precedes it), as in OpenAI's legacy API and vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sparsekv.outputs import Logprob, RequestOutput
from sparsekv.server.text_offsets import REPLACEMENT_CHAR, TextOffsets, token_bytes_text


@dataclass
class _Unscored:
    """The first prompt token in echoed logprobs: nothing precedes it, so no logprob."""

    token_id: int
    logprob: None = None
    top: None = None


class LegacyLogprobs:
    """The logprobs objects of one completion request, streamed or not: it keeps each choice's
    text offsets between chunks.

    Args:
        tokenizer: the served tokenizer (``decode``, ``bos_token_id``, ``bos_token``).
        token_bytes: a token id's raw bytes.
        prompt_text: the echoed prompt (``""`` without ``echo``).
        echo: the prompt is echoed before the generated text.
        echo_as_sent: the prompt was text, echoed as the client sent it.
        skip_special: ``skip_special_tokens`` of the request.
        num_logprobs: how many top logprobs each token lists (``logprobs``).
    """

    def __init__(
        self,
        tokenizer: Any,
        token_bytes: Callable[[int], bytes],
        prompt_text: str,
        echo: bool,
        echo_as_sent: bool,
        skip_special: bool,
        num_logprobs: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.prompt_text = prompt_text
        self.echo = echo
        self.echo_as_sent = echo_as_sent
        self.skip_special = skip_special
        self.num_logprobs = num_logprobs
        self.offsets: dict[int, TextOffsets] = {}  # per choice: its generated tokens
        self.echo_offsets: list[int] | None = None  # the echoed prompt tokens' (all choices)
        self.token_texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """A token's text alone, or ``bytes:\\xNN...`` when its bytes are not UTF-8 text
        (a piece of a character: its decode alone would be U+FFFD, like any other piece)."""
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if REPLACEMENT_CHAR in text:
                raw = self.token_bytes(token_id)
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = token_bytes_text(raw)
            self.token_texts[token_id] = text
        return text

    def echo_offsets_of(self, prompt_ids: list[int]) -> list[int]:
        """The echoed prompt tokens' offsets in ``prompt_text`` (the same for every choice).

        A text prompt is echoed as sent, special tokens' text included, so it is measured
        without skipping them, except a BOS the tokenizer added in front of a text that
        does not start with it (Gemma 3), which takes no character."""
        if self.echo_offsets is None:
            skip = self.skip_special and not self.echo_as_sent
            tokenizer = self.tokenizer
            lead = 0
            bos_id = getattr(tokenizer, "bos_token_id", None)
            bos_text = getattr(tokenizer, "bos_token", None)
            if self.echo_as_sent and bos_id is not None and prompt_ids[:1] == [bos_id]:
                lead = int(not (bos_text and self.prompt_text.startswith(bos_text)))
            offsets = TextOffsets(tokenizer, [], skip)
            end = len(self.prompt_text)
            self.echo_offsets = [0] * lead + [min(offsets.add(t), end) for t in prompt_ids[lead:]]
        return self.echo_offsets

    def build(
        self,
        output: RequestOutput,
        index: int,
        records: list[Logprob | None],
        num_echo: int = 0,
        text_end: int | None = None,
    ) -> dict:
        """OpenAI's legacy shape: tokens, token_logprobs, top_logprobs, text_offset (each
        token's first character in the choice's ``text``, see ``TextOffsets``; a token the
        text skips, a special one under ``skip_special_tokens``, takes none). The first
        ``num_echo`` records are the echoed prompt's. ``text_end``: the choice's whole text
        length once it is known (offsets of tokens whose text a stop string cut stop there).
        """
        offsets: list[int] = []
        if num_echo:
            offsets += self.echo_offsets_of(output.prompt_token_ids)[:num_echo]
        tracker = self.offsets.get(index)
        if tracker is None:
            tracker = TextOffsets(self.tokenizer, output.prompt_token_ids, self.skip_special)
            self.offsets[index] = tracker
        base = len(self.prompt_text) if self.echo else 0
        offsets += [base + tracker.add(r.token_id) for r in records[num_echo:]]
        if text_end is not None:
            offsets = [min(offset, text_end) for offset in offsets]
        tokens, values, tops = [], [], []
        for record in records:
            tokens.append(self.token_text(record.token_id))
            values.append(record.logprob)
            if record.top is None:
                tops.append(None)
            else:
                top = record.top[: self.num_logprobs or 0]
                tops.append({self.token_text(t): lp for t, lp in top})
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def echo_records(self, output: RequestOutput) -> list[Logprob]:
        """The prompt tokens' records: the first one with ``null`` logprob and top."""
        return [_Unscored(output.prompt_token_ids[0]), *(output.prompt_logprobs or [])[1:]]

    def prompt_logprobs(self, output: RequestOutput) -> list[dict | None]:
        """vLLM's shape: per prompt token ``{token_id: {logprob, rank, decoded_token}}``."""
        decode = self.tokenizer.decode
        result: list[dict | None] = []
        for record in output.prompt_logprobs or []:
            if record is None:
                result.append(None)
                continue
            entry = {
                str(record.token_id): {
                    "logprob": record.logprob,
                    "rank": record.rank,
                    "decoded_token": decode([record.token_id]),
                }
            }
            for rank, (token_id, logprob) in enumerate(record.top, start=1):
                entry.setdefault(
                    str(token_id),
                    {"logprob": logprob, "rank": rank, "decoded_token": decode([token_id])},
                )
            result.append(entry)
        return result
