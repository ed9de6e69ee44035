"""Prompt encoding: raw text, token ids, or chat messages rendered with the model's template."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence

from sparsekv.engine.token_bytes import TokenBytes

Prompt = str | Sequence[int] | Sequence[dict]


# The message roles of the OpenAI chat API (the server's request schema accepts the same);
# "developer" reaches the template as "system", as OpenAI defines it.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        prompt: text (tokenized with the tokenizer's own special-token rule, except that a
            text that already starts with the BOS token's text, such as a chat-templated
            Gemma 3 prompt, gets no second BOS), a list of token ids, or a list of chat
            messages ``{"role", "content"}`` (rendered with the chat template and the
            assistant header; the template's BOS is not doubled).

    Raises:
        ValueError: an empty prompt, text that is not valid Unicode (a lone surrogate), a list
            mixing kinds, or a malformed message list.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: the prompt is empty")
        check_text(prompt, "prompt")
        return _single_bos(tokenizer, prompt, list(tokenizer(prompt)["input_ids"]))
    if isinstance(prompt, bytes | Mapping) or not isinstance(prompt, Iterable):
        raise ValueError(
            "prompt: expected text, a list of token ids, or a list of chat messages, got "
            f"{type(prompt).__name__}"
        )
    items = list(prompt)
    if not items:
        raise ValueError("prompt: the prompt is empty")
    if all(isinstance(t, numbers.Integral) for t in items):  # int, numpy integers
        # bool is an int subclass: True / False would silently become token ids 1 / 0
        if any(isinstance(t, bool) for t in items):
            raise ValueError("prompt: token ids must be integers, got a boolean")
        return [int(t) for t in items]
    if all(isinstance(m, dict) for m in items):
        return render_chat(tokenizer, items)
    raise ValueError("prompt: expected text, a list of token ids, or a list of chat messages")


def check_text(text: str, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` if ``text`` is not valid Unicode: a lone surrogate
    (``"\\ud800"``) that the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{where}: text is not valid Unicode (it holds a lone surrogate)"
        ) from None


def _single_bos(tokenizer, text: str, ids: list[int]) -> list[int]:
    """``ids`` without the BOS the tokenizer added in front of a text that starts with BOS."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    bos_text = getattr(tokenizer, "bos_token", None)
    if bos_id is not None and bos_text and text.startswith(bos_text) and ids[:2] == [bos_id] * 2:
        return ids[1:]
    return ids


def max_prompt_chars(token_bytes: TokenBytes, max_model_len: int) -> int:
    """The most characters a text prompt that fits in ``max_model_len`` tokens can have.

    Every token covers at most as many characters of the text as its raw bytes, and a prompt
    that fits has at most ``max_model_len - 1`` tokens, so a longer text can be rejected
    before tokenizing it. (Tokenizers whose normalizer deletes characters are not bounded
    this way; none of the built-in models has one.)
    """
    return token_bytes.longest * max(1, max_model_len - 1)


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Apply the chat template and return token ids.

    Raises:
        ValueError: a message lacks ``role`` or ``content``, its content is not text (or not
            valid Unicode), or the tokenizer has no template.
    """
    for i, message in enumerate(messages):
        if "role" not in message or "content" not in message:
            raise ValueError(f"messages[{i}]: each message needs 'role' and 'content'")
        if not isinstance(message["content"], str):
            raise ValueError(
                f"messages[{i}].content: expected text, got {type(message['content']).__name__}"
            )
        check_text(message["content"], f"messages[{i}].content")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}].role: {message['role']!r} is not one of {', '.join(CHAT_ROLES)}"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: the model's tokenizer has no chat template")
    messages = [
        dict(message, role="system") if message["role"] == "developer" else message
        for message in messages
    ]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    # The template already carries any BOS; tokenizing without special tokens avoids a double.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_context_tokens(tokenizer, messages: list[dict], prompt_ids: Sequence[int]) -> int:
    """Length of the shared context of a chat prompt (``kv_compression.scope = "context"``):
    the tokens before the last user message, i.e. the longest common token prefix of
    ``prompt_ids`` and the template rendering of the messages before it (no generation
    prompt). 0 when the conversation has no earlier message.

    Args:
        tokenizer: the tokenizer ``prompt_ids`` came from (``render_chat``).
        messages: the conversation (``{"role", "content"}`` dicts).
        prompt_ids: ``render_chat(tokenizer, messages, ...)``.
    """
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
    if last_user == 0:
        return 0
    before = render_chat(tokenizer, messages[:last_user], add_generation_prompt=False)
    common = 0
    for a, b in zip(before, prompt_ids):
        if a != b:
            break
        common += 1
    return common
