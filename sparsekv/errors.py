"""Errors of the engine's API that callers tell apart from other ``ValueError``s."""

from __future__ import annotations


class ContextLengthError(ValueError):
    """A request that does not fit the model's context: a prompt of at least ``max_model_len``
    tokens, or a prompt plus ``max_tokens`` over it. The server answers it as OpenAI does, a
    400 with the code ``context_length_exceeded``; the message starts with the parameter name,
    as every engine ``ValueError``'s does."""
