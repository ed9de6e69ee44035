"""The raw UTF-8 bytes of each token id, read from the tokenizer's vocabulary.

A token may hold part of a character (byte-level BPE pieces, SentencePiece byte fallback
``<0xF0>``); ``decode([id])`` then gives U+FFFD, which loses the bytes a client needs to rebuild
the character (OpenAI's logprob ``bytes`` field). The vocabulary strings keep them:

- byte-level BPE (GPT-2, SmolLM2): every character of a token string stands for one byte
  through GPT-2's printable byte alphabet;
- SentencePiece (Gemma 3): ``<0xNN>`` is the byte ``NN``; other pieces are UTF-8 text with
  ``▁`` standing for a space.
"""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: printable character -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return False
    try:
        state = decoder.__getstate__()
    except (AttributeError, TypeError):
        return False
    return b'"ByteLevel"' in (state if isinstance(state, bytes) else str(state).encode())


class TokenBytes:
    """Token id -> raw bytes for one tokenizer (build once; lookups are cached).

    Args:
        tokenizer: a Hugging Face tokenizer (``convert_ids_to_tokens`` and ``len`` are used).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self._special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        self._cache: dict[int, bytes] = {}
        self._longest: int | None = None

    def _piece_bytes(self, piece: str | None) -> bytes:
        if piece is None:
            return b""
        if piece in self._special:
            return piece.encode("utf-8")
        if self.byte_level:
            alphabet = _byte_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode("utf-8")  # an added token stored as plain text
        match = _BYTE_PIECE.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace(_SPIECE_SPACE, " ").encode("utf-8")

    def __call__(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` adds to the text (special tokens: their text)."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._piece_bytes(self.tokenizer.convert_ids_to_tokens(int(token_id)))
            self._cache[token_id] = cached
        return cached

    @property
    def longest(self) -> int:
        """Bytes of the longest token in the vocabulary (computed once)."""
        if self._longest is None:
            pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self._longest = max((len(self._piece_bytes(p)) for p in pieces), default=1)
        return max(1, self._longest)
