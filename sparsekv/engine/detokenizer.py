"""Incremental detokenization with stop strings, using the prompt's last tokens as context.

Invariants:

- With no stop string fired, ``prompt_text`` plus the deltas of ``append`` plus ``flush()``
  concatenate to exactly ``tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=...)``
  (``prompt_text`` is the prompt's text up to its last complete character).
- Bytes of a character that the prompt leaves unfinished are completed by the output: a
  prompt ending in the first two bytes of an emoji and an output holding the other two gives
  an output text starting with the emoji, not with U+FFFD.
- A delta never ends inside a UTF-8 character: while the decoded window ends in U+FFFD the
  text is held back (``flush`` releases it, replacement character included, at EOS / length).
- Text that could be the start of a stop string is held back until it cannot be, so a stop
  string is never half-sent; once one matches, the text ends just before it (or just after it
  with ``include_stop_str_in_output``) and nothing more is emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sparsekv.engine.stop_prefix import StopPrefix
from sparsekv.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Prompt ids decoded as context for the first output tokens (vLLM uses 5 to 6).
PROMPT_CONTEXT_TOKENS = 6


def prompt_context(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> list[int]:
    """The prompt's last ``PROMPT_CONTEXT_TOKENS`` ids, extended to the left (by up to 3 ids)
    while they start inside a character, so their decode starts on a character boundary."""
    start = max(0, len(ids) - PROMPT_CONTEXT_TOKENS)
    lowest = max(0, start - 3)
    while start > lowest:
        text = tokenizer.decode(list(ids[start:]), skip_special_tokens=skip_special_tokens)
        if not text.startswith(_REPLACEMENT_CHAR):
            break
        start -= 1
    return list(ids[start:])


def unfinished_tail(tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> int:
    """How many trailing ``ids`` end in an unfinished UTF-8 character: their text belongs to
    the output that completes it (an unfinished character holds at most 3 bytes, but skipped
    special tokens may sit between them)."""
    context = prompt_context(tokenizer, ids, skip_special_tokens)
    end = len(context)
    while end > 0:
        text = tokenizer.decode(context[:end], skip_special_tokens=skip_special_tokens)
        if not text.endswith(_REPLACEMENT_CHAR):
            break
        end -= 1
    return len(context) - end


@dataclass
class DetokenizerStep:
    """What one token added to the text.

    Attributes:
        delta_text: newly released text (may be empty while text is held back).
        stop: the stop string that matched (generation must end), else ``None``.
    """

    delta_text: str
    stop: str | None = None


class IncrementalDetokenizer:
    """Turns one sample's generated tokens into text, a token at a time.

    Decoding works on a short window of ids, as vLLM's ``detokenize_incrementally``: the ids
    from ``prefix_offset`` (start of the last released chunk) to the end are decoded and
    compared with the decode of ``[prefix_offset, read_offset)``; the difference is the new
    text. Decoding the prefix chunk together with the new ids keeps tokenizers whose decoders
    depend on context (leading-space stripping, byte fallback) consistent with a full decode,
    at two decodes of a few ids per token.

    The window starts inside the prompt: its last ``PROMPT_CONTEXT_TOKENS`` ids (more if
    they start inside a character) are decoding context, and prompt ids that end in an unfinished UTF-8 character count as not yet read,
    so the output's first complete text includes that character. The output text is therefore
    ``decode(prompt_ids + output_ids)`` minus ``prompt_text``, streamed or not.

    Args:
        tokenizer: a Hugging Face tokenizer (only ``decode`` is used).
        prompt_ids: the request's prompt ids (their tail is decoding context).
        params: ``stop``, ``include_stop_str_in_output``, ``skip_special_tokens`` and
            ``min_tokens`` (stop strings fire only once that many tokens were generated) are
            read.
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = [s for s in params.stop if s]
        self._include_stop = params.include_stop_str_in_output
        self._stop_prefixes = [] if self._include_stop else [StopPrefix(s) for s in self._stops]
        self._min_tokens = params.min_tokens
        context = prompt_context(tokenizer, prompt_ids, self._skip_special_tokens)
        self._num_context = len(context)
        self._ids: list[int] = context  # prompt context, then the output ids
        self._read_offset = len(context) - unfinished_tail(
            tokenizer, context, self._skip_special_tokens
        )
        self._prefix_offset = max(0, self._read_offset - 5)
        self._num_pending_prompt = len(context) - self._read_offset
        self._decoded = ""  # all complete text decoded so far (released + held back)
        self._num_released = 0  # characters of ``_decoded`` released as deltas
        self._held_back = 0  # characters at the end of ``_decoded`` that may start a stop string
        self.stop: str | None = None

    @property
    def text(self) -> str:
        """All text released so far (the concatenation of the deltas and flushes)."""
        return self._decoded[: self._num_released]

    @property
    def output_ids(self) -> list[int]:
        """The generated ids appended so far."""
        return self._ids[self._num_context :]

    @property
    def num_unfinished_prompt_ids(self) -> int:
        """Trailing prompt ids whose character is unfinished (their text is output text)."""
        return self._num_pending_prompt

    def append(self, token_id: int) -> DetokenizerStep:
        """Adds one generated token.

        Args:
            token_id: the sampled id (EOS and stop token ids too: the engine decides to stop
                on them; their text shows only when ``skip_special_tokens`` is off).

        Returns:
            The released text and, if a stop string matched, that string. After a match,
            further calls release nothing and repeat the stop string.
        """
        if self.stop is not None:
            return DetokenizerStep("", self.stop)
        self._ids.append(token_id)
        new_text = self._decode_new_text()
        if not new_text:
            return DetokenizerStep("")
        num_old = len(self._decoded)
        self._decoded += new_text
        self._held_back = max((p.feed(new_text) for p in self._stop_prefixes), default=0)
        if len(self._ids) - self._num_context >= self._min_tokens:
            match = self._find_stop(num_old)
            if match is not None:
                return self._release_until_stop(*match)
        return DetokenizerStep(self._release(len(self._decoded) - self._held_back_length()))

    def flush(self) -> str:
        """Releases everything held back, at EOS or the length limit.

        Returns:
            The rest of the text (a character that never completed comes out as U+FFFD, as
            in the full decode); ``""`` after a stop string matched or when no output id came.
            Stop strings are not searched in this last piece.
        """
        if self.stop is not None:
            return ""
        if self._read_offset < len(self._ids) and len(self._ids) > self._num_context:
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
            self._decoded += self._decode(self._prefix_offset, None)[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        return self._release(len(self._decoded))

    def _decode(self, start: int, end: int | None) -> str:
        window = self._ids[start:end]
        return self._tokenizer.decode(window, skip_special_tokens=self._skip_special_tokens)

    def _decode_new_text(self) -> str:
        """Complete text the window gained, advancing the offsets; ``""`` while incomplete."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset, None)
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def _find_stop(self, num_old: int) -> tuple[int, str] | None:
        """Earliest stop match ending in the new text (after ``num_old`` chars); list order
        breaks ties."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._decoded.find(stop, max(0, num_old - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _release_until_stop(self, index: int, stop: str) -> DetokenizerStep:
        end = index + len(stop) if self._include_stop else index
        # Held-back text guarantees the match starts after everything already released.
        assert end >= self._num_released, "stop string overlaps released text"
        self._decoded = self._decoded[:end]
        self.stop = stop
        return DetokenizerStep(self._release(end), stop)

    def _held_back_length(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string.

        With ``include_stop_str_in_output`` nothing is held: a released prefix of a stop
        string stays in the output whether or not the stop completes. Kept up to date by
        ``append`` (``stop_prefix.StopPrefix``: linear in the text, not quadratic).
        """
        return self._held_back

    def _release(self, end: int) -> str:
        end = max(end, self._num_released)
        delta = self._decoded[self._num_released : end]
        self._num_released = end
        return delta
