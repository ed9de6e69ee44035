"""Token counting with the chat template, and fitting a prompt to a target length.

RULER (arXiv 2404.06654) sizes every sample so that the templated prompt plus
the expected answer lands within a few tokens of the target context length. Here a task
describes its prompt as a function of one integer (haystack words, list items), and
:func:`fit_length` searches that integer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Draft:
    """A task's prompt at one size, before it is measured.

    Attributes:
        prompt: the user message text.
        answers: the reference strings a perfect reader outputs.
        metadata: task details worth keeping (needle positions, keys, counts).
        answer_prefix: the start of the answer, written into the prompt after the assistant
            header (RULER's answer prefix: it asks for the answer without a preamble, and lets
            base models without chat training answer at all).
    """

    prompt: str
    answers: list[str]
    metadata: dict[str, Any] = field(default_factory=dict)
    answer_prefix: str = ""

    @property
    def messages(self) -> list[dict[str, str]]:
        """The prompt as a one-turn chat."""
        return [{"role": "user", "content": self.prompt}]

    @property
    def answer_text(self) -> str:
        """The answer a perfect reader writes: the references joined by ``", "``."""
        return ", ".join(self.answers)


def _token_ids(encoded: Any) -> list[int]:
    """Token ids from what ``apply_chat_template(tokenize=True)`` returned.

    transformers 4 returns a list of ints; transformers 5 a ``BatchEncoding`` (a mapping with
    ``input_ids``), possibly batched.
    """
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], (list, tuple)):
        encoded = encoded[0]
    return list(encoded)


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return getattr(tokenizer, "chat_template", None) is not None


def prompt_token_ids(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of ``messages`` as the engine sees them.

    With a chat template: ``apply_chat_template(messages, add_generation_prompt=True)``.
    Without one: the concatenated contents encoded with the tokenizer's special tokens.
    """
    if has_chat_template(tokenizer):
        encoded = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True
        )
        return _token_ids(encoded)
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text))


def answer_prefix_ids(tokenizer: Any, answer_prefix: str) -> list[int]:
    """Token ids of an answer prefix, encoded without special tokens (empty for ``""``)."""
    if not answer_prefix:
        return []
    return list(tokenizer.encode(answer_prefix, add_special_tokens=False))


def count_tokens(tokenizer: Any, draft: Draft) -> tuple[int, int]:
    """``(prompt_tokens, answer_tokens)`` of a draft (the prompt counts its answer prefix); the
    answer is encoded without specials."""
    num_prompt = len(prompt_token_ids(tokenizer, draft.messages))
    num_prompt += len(answer_prefix_ids(tokenizer, draft.answer_prefix))
    num_answer = len(tokenizer.encode(draft.answer_text, add_special_tokens=False))
    return num_prompt, num_answer


@dataclass(frozen=True)
class Fit:
    """The result of :func:`fit_length`.

    Attributes:
        num_units: the size passed to the task's builder.
        draft: the built prompt.
        num_prompt_tokens: templated prompt tokens.
        num_answer_tokens: tokens of the expected answer text.
    """

    num_units: int
    draft: Draft
    num_prompt_tokens: int
    num_answer_tokens: int

    @property
    def num_tokens(self) -> int:
        """Prompt plus answer tokens: the quantity fitted to the target."""
        return self.num_prompt_tokens + self.num_answer_tokens


def fit_length(
    build: Callable[[int], Draft],
    tokenizer: Any,
    target: int,
    *,
    min_units: int = 0,
) -> Fit:
    """Find the builder size whose prompt + answer tokens are closest to ``target``.

    Token counts grow with the size (by a word or a list item at a time), so an exponential
    then binary search finds the largest size at or under the target, and its neighbours are
    compared to absorb small non-monotone steps of the tokenizer.

    Args:
        build: builds the task at a size (number of haystack words, list items...).
        tokenizer: a Hugging Face tokenizer, with or without a chat template.
        target: wanted prompt + answer length, in tokens.
        min_units: smallest meaningful size for the task.

    Raises:
        ValueError: the task at ``min_units`` is already longer than ``target``.
    """
    cache: dict[int, Fit] = {}

    def measure(units: int) -> Fit:
        if units not in cache:
            draft = build(units)
            cache[units] = Fit(units, draft, *count_tokens(tokenizer, draft))
        return cache[units]

    smallest = measure(min_units)
    if smallest.num_tokens > target:
        raise ValueError(
            f"target length {target} is too short: the task needs {smallest.num_tokens} tokens "
            f"at its smallest size ({min_units} units)"
        )
    lo, hi = min_units, max(min_units + 1, target)
    while measure(hi).num_tokens <= target:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # invariant: measure(lo) <= target < measure(hi)
        mid = (lo + hi) // 2
        if measure(mid).num_tokens <= target:
            lo = mid
        else:
            hi = mid
    candidates = [measure(u) for u in range(max(min_units, lo - 2), lo + 3)]
    return min(candidates, key=lambda f: (abs(f.num_tokens - target), f.num_tokens > target))
