"""Character offsets and texts of tokens in the legacy completions logprobs.

``TextOffsets`` gives each token of a run its first character in the text the run decodes to
(``text_offset``); ``token_bytes_text`` writes a token whose bytes are not UTF-8 text on their
own (a piece of a character split over tokens) as OpenAI's legacy API does, ``bytes:\\xNN``.
"""

from __future__ import annotations

from collections.abc import Sequence

from sparsekv.engine.detokenizer import prompt_context, unfinished_tail

__all__ = ["REPLACEMENT_CHAR", "TextOffsets", "token_bytes_text"]

REPLACEMENT_CHAR = "\ufffd"


def token_bytes_text(raw: bytes) -> str:
    """OpenAI's legacy text of a token that is not UTF-8 on its own: ``bytes:`` then each
    byte, printable ASCII as itself and the others (backslash too) as ``\\xNN``."""
    return "bytes:" + "".join(
        chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw
    )


class TextOffsets:
    """The offset of each token of a run in the text the run decodes to, a token at a time.

    The offset of a token is the number of characters the tokens before it complete: a
    token holding the first bytes of a character split over several tokens, and the tokens
    that continue it, all get that character's offset; a token that adds no text (a special
    token the text skips) gets the offset of what follows. Offsets never decrease and never
    pass the text's length.

    Decoding is incremental, as the engine's ``IncrementalDetokenizer`` (whose text the
    offsets index): a short window of ids from the start of the last released text is
    decoded, and the characters it completes beyond that start are counted; while the window
    ends in an unfinished character (U+FFFD), the window grows and only the characters before
    it count. (A U+FFFD that stands for invalid bytes in the text itself is counted once the
    text after it arrives: the token right after it gets the offset of that U+FFFD.)

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        context: ids that precede the run (the prompt, for generated tokens): its last ids are
            decoding context, and an unfinished character at its end is completed by the run
            (its offset is 0), as in the engine's detokenizer.
        skip_special_tokens: decode as the text was decoded.
    """

    def __init__(self, tokenizer, context: Sequence[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        ids = prompt_context(tokenizer, context, skip_special_tokens) if context else []
        self._ids: list[int] = ids
        unfinished = unfinished_tail(tokenizer, ids, skip_special_tokens) if ids else 0
        self._read = len(ids) - unfinished  # ids up to here are in the released text
        self._prefix = max(0, self._read - 5)  # the window starts here
        self._released = 0  # characters of the run up to ``_read``
        self._length = 0  # characters the run completed so far

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> int:
        """The next token's offset (characters completed before it)."""
        offset = self._length
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix, self._read)
        window_text = self._decode(self._prefix)
        if window_text.endswith(REPLACEMENT_CHAR):
            # An unfinished character (one U+FFFD, or one per byte where the decoder falls
            # back to bytes): the complete ones before it count, and the window grows.
            complete = len(window_text.rstrip(REPLACEMENT_CHAR)) - len(prefix_text)
            self._length = max(self._length, self._released + max(0, complete))
        elif len(window_text) > len(prefix_text):
            self._released += len(window_text) - len(prefix_text)
            self._length = self._released
            self._prefix, self._read = self._read, len(self._ids)
        return offset
