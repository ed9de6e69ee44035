"""Errors of the engine's API that callers tell apart from other ``ValueError``s."""

from __future__ import annotations


class ContextLengthError(ValueError):
    """A request that does not fit the model's context: a prompt of at least ``max_model_len``
    tokens, or a prompt plus ``max_tokens`` over it. The server answers it as OpenAI does, a
    400 with the code ``context_length_exceeded``; the message starts with the parameter name,
    as every engine ``ValueError``'s does."""


class PoolTooSmallError(ValueError):
    """A request whose peak KV footprint (prompt plus ``max_tokens``, after compression) exceeds
    the whole page pool: it could never run, whatever else finishes. The message starts with
    ``max_tokens:``. The engine sizes an implicit ``max_tokens`` (``None``) below this bound."""
