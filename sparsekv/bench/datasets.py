"""Prompt sets for the serving benchmark: random tokens, long documents, a shared prefix.

Every dataset is built from a tokenizer and a seed, so each server in a sweep sees the same
prompts. Prompts are token ids of exactly ``input_len`` tokens; with ``prompt_format="text"``
they are decoded to text for servers that take no token ids (the server's own tokenization may
then differ by a few tokens; the usage it reports is what the benchmark records).

==================  =======================================================================
name                prompts
==================  =======================================================================
``random``          uniform random token ids, special tokens excluded (vLLM's random set)
``long-doc``        real text found on this machine (licenses, stdlib sources) cut to length
``shared-prefix``   ``num_prefixes`` random prefixes of ``prefix_len`` tokens, taken in turn,
                    each followed by a distinct random suffix
==================  =======================================================================
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DATASETS = ("random", "long-doc", "shared-prefix")
PROMPT_FORMATS = ("token-ids", "text")


@dataclass(frozen=True)
class BenchPrompt:
    """One request of a serving benchmark.

    Attributes:
        prompt: token ids, or text for ``--prompt-format text``.
        num_prompt_tokens: tokens of the prompt under the dataset's tokenizer.
        output_len: ``max_tokens`` (the server ignores EOS, so this many come back).
    """

    prompt: list[int] | str
    num_prompt_tokens: int
    output_len: int


def load_tokenizer(model: str) -> Any:
    """The tokenizer of a built-in model name, GGUF file or Hugging Face folder (no weights).

    Raises:
        ValueError: the model cannot be resolved (message starts with ``model:``).
    """
    from sparsekv.loader import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from sparsekv.loader.gguf_file import read_gguf
    from sparsekv.loader.gguf_metadata import load_gguf_config_and_tokenizer

    return load_gguf_config_and_tokenizer(read_gguf(path))[1]


def allowed_token_ids(tokenizer: Any) -> list[int]:
    """Every id of the tokenizer's vocabulary except its special and added tokens."""
    banned = set(getattr(tokenizer, "all_special_ids", []) or [])
    banned |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [t for t in range(len(tokenizer)) if t not in banned]


def random_ids(tokenizer: Any, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """``num_prompts`` lists of ``input_len`` uniform random non-special token ids."""
    allowed = allowed_token_ids(tokenizer)
    rng = random.Random(seed)
    return [rng.choices(allowed, k=input_len) for _ in range(num_prompts)]


def long_doc_ids(tokenizer: Any, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Real documents of at least ``input_len`` tokens, cut to ``input_len``.

    Each prompt is a different document while they last; past that the documents repeat,
    each repeat rotated by a different offset so no two prompts share a prefix (a server's
    prefix cache must not turn repeats into hits).

    Raises:
        ValueError: no document of ``input_len`` tokens exists on this machine.
    """
    from sparsekv.evaluation.fidelity import long_texts

    del seed  # the documents come in a fixed order; kept for a uniform signature
    texts = long_texts(tokenizer, min_tokens=input_len, count=num_prompts)
    if not texts:
        raise ValueError(f"input_len: no document of {input_len} tokens found on this machine")
    docs = [tokenizer.encode(text, add_special_tokens=False)[:input_len] for _, text in texts]
    docs = [doc + doc[: input_len - len(doc)] for doc in docs]  # re-encoding may lose a token
    prompts = []
    for index in range(num_prompts):
        doc = docs[index % len(docs)]
        repeat = index // len(docs)
        shift = (repeat * input_len) // (num_prompts // len(docs) + 1)
        prompts.append(doc[shift:] + doc[:shift])
    return prompts


def shared_prefix_ids(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    seed: int,
    prefix_len: int,
    num_prefixes: int = 1,
) -> list[list[int]]:
    """Prompts sharing one of ``num_prefixes`` random prefixes, each with a distinct suffix.

    Prompt ``i`` starts with prefix ``i % num_prefixes`` (the groups interleave, as requests
    of several conversations or documents do), followed by ``input_len - prefix_len`` random
    tokens of its own.

    Raises:
        ValueError: ``prefix_len`` is not in ``[1, input_len)`` or ``num_prefixes`` < 1.
    """
    if not 0 < prefix_len < input_len:
        raise ValueError(f"prefix_len must be in [1, input_len={input_len}), got {prefix_len}")
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    prefixes = random_ids(tokenizer, num_prefixes, prefix_len, seed)
    suffixes = random_ids(tokenizer, num_prompts, input_len - prefix_len, seed + 1)
    return [prefixes[i % num_prefixes] + suffix for i, suffix in enumerate(suffixes)]


def build_prompts(
    tokenizer: Any,
    dataset: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    *,
    seed: int = 0,
    prefix_len: int = 0,
    num_prefixes: int = 1,
    prompt_format: str = "token-ids",
) -> list[BenchPrompt]:
    """The prompts of one benchmark run.

    Args:
        tokenizer: Hugging Face tokenizer of the served model.
        dataset: one of :data:`DATASETS`.
        num_prompts: requests wanted.
        input_len: prompt tokens per request.
        output_len: output tokens per request.
        seed: makes the set reproducible.
        prefix_len: shared tokens (``shared-prefix`` only).
        num_prefixes: distinct shared prefixes (``shared-prefix`` only).
        prompt_format: ``token-ids`` or ``text`` (decoded ids).

    Raises:
        ValueError: an unknown dataset or format, or non-positive sizes.
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset: unknown {dataset!r}; choose one of {', '.join(DATASETS)}")
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be >= 1")
    builders: dict[str, Callable[..., list[list[int]]]] = {
        "random": random_ids,
        "long-doc": long_doc_ids,
        "shared-prefix": lambda *a: shared_prefix_ids(
            *a, prefix_len=prefix_len, num_prefixes=num_prefixes
        ),
    }
    ids = builders[dataset](tokenizer, num_prompts, input_len, seed)
    if prompt_format == "text":
        return [BenchPrompt(tokenizer.decode(p), len(p), output_len) for p in ids]
    return [BenchPrompt(p, len(p), output_len) for p in ids]
