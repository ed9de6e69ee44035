"""IncrementalDetokenizer on SmolLM2's real (byte-level BPE) tokenizer."""

from __future__ import annotations

import random

import pytest

from sparsekv.engine.detokenizer import IncrementalDetokenizer
from sparsekv.sampling_params import SamplingParams

TEXTS = [
    "Hello 世界 🚀 naïve café – ok",
    "日本語のテキストと한국어 텍스트, Ελληνικά, русский текст.",
    "emoji soup: 👩‍👩‍👧‍👦🏳️‍🌈🤖🦀 e\u0301 ﬁ ½ ∑ ∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x  # tabs\tand  double  spaces\n\n\nend ",
    " leading space and trailing space ",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, ids, params=None, flush=True):
    """Feeds ``ids`` one at a time; returns (detokenizer, deltas, stops per step)."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], params or SamplingParams())
    deltas, stops = [], []
    for token_id in ids:
        step = detok.append(token_id)
        deltas.append(step.delta_text)
        stops.append(step.stop)
        if step.stop is not None:
            break
    if flush:
        deltas.append(detok.flush())
    return detok, deltas, stops


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    detok, deltas, stops = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text
    assert all("\ufffd" not in d for d in deltas)
    assert stops == [None] * len(ids)


def test_random_ids_including_broken_utf8(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        # Byte-level pieces of multi-byte characters (ids < 256 hold single bytes).
        ids += [rng.randrange(256) for _ in range(3)]
        detok, deltas, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=False)
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])  # only flush may end broken


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    ids = [1] + encode(tokenizer, "assistant\nHi 🚀 there") + [2] + encode(tokenizer, " more") + [2]
    params = SamplingParams(skip_special_tokens=skip)
    _, deltas, _ = stream(tokenizer, ids, params)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def test_partial_characters_are_held_back_then_released(tokenizer):
    ids = encode(tokenizer, "a🚀b")
    assert len(ids) > 3  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    released = [detok.append(t).delta_text for t in ids]
    assert released[0] == "a" and "".join(released) == "a🚀b"
    assert all(d in ("", "a", "🚀", "b", "🚀b") for d in released)
    # Stopping mid-character: flush emits what a full decode shows (a replacement char).
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    cut = ids[:2]
    assert "".join(detok.append(t).delta_text for t in cut) == "a"
    assert "a" + detok.flush() == tokenizer.decode(cut)


def test_stop_string_spanning_tokens_is_never_half_sent(tokenizer):
    text = "we want world peace now"
    ids = encode(tokenizer, text)
    detok, deltas, stops = stream(tokenizer, ids, SamplingParams(stop=["world peace"]))
    assert "".join(deltas) == "we want " == detok.text  # nothing retracted, nothing after
    assert stops[-1] == "world peace" and stops[:-1] == [None] * (len(stops) - 1)
    assert len(stops) < len(ids)  # fired at the token completing "peace", before " now"
    assert detok.append(ids[-1]).delta_text == "" and detok.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_cut_at_the_first_match(tokenizer, include):
    rng = random.Random(1)
    for text in TEXTS:
        ids = encode(tokenizer, text)
        for _ in range(10):
            start = rng.randrange(len(text) - 1)
            stop = text[start : start + rng.randrange(1, 12)]
            params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
            detok = IncrementalDetokenizer(tokenizer, [], params)
            end = text.find(stop) + (len(stop) if include else 0)
            for token_id in ids:
                step = detok.append(token_id)
                assert text[:end].startswith(detok.text)  # released text is never retracted
                if step.stop is not None:
                    break
            assert detok.stop == stop and detok.text == text[:end]


def test_near_miss_is_held_then_released(tokenizer):
    text = "world peas and world peace"
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="world peace"))
    released = []
    for token_id in ids:
        step = detok.append(token_id)
        released.append(step.delta_text)
        # The text released so far never ends in the beginning of the stop string.
        assert not any(detok.text.endswith("world peace"[:k]) for k in range(1, 12))
    assert step.stop == "world peace"
    assert "".join(released) == "world peas and "


def test_include_stop_str_in_output(tokenizer):
    ids = encode(tokenizer, "we want world peace now")
    params = SamplingParams(stop=["world peace"], include_stop_str_in_output=True)
    detok, deltas, stops = stream(tokenizer, ids, params)
    assert "".join(deltas) == "we want world peace" == detok.text
    assert stops[-1] == "world peace"


def test_earliest_stop_wins_and_stop_inside_one_token(tokenizer):
    ids = encode(tokenizer, "we want world peace now")
    detok, deltas, _ = stream(tokenizer, ids, SamplingParams(stop=["peace", "want"]))
    assert detok.stop == "want" and "".join(deltas) == "we "
    detok, deltas, _ = stream(tokenizer, ids, SamplingParams(stop=["we"]))
    assert detok.stop == "we" and "".join(deltas) == ""


def test_multibyte_stop_string(tokenizer):
    ids = encode(tokenizer, "Hello 世界 🚀 naïve")
    detok, deltas, _ = stream(tokenizer, ids, SamplingParams(stop=["界 🚀"]))
    assert detok.stop == "界 🚀" and "".join(deltas) == "Hello 世"


def test_flush_releases_held_back_text_at_the_end(tokenizer):
    text = "we want world peace"
    ids = encode(tokenizer, text)
    detok, deltas, stops = stream(tokenizer, ids, SamplingParams(stop=["peace please"]), False)
    assert "".join(deltas) == "we want world "  # "peace" could still become the stop
    assert detok.flush() == "peace"
    assert detok.text == text and stops == [None] * len(ids)


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = encode(tokenizer, "stop here, then more stop words")
    num_first = len(encode(tokenizer, "stop here,"))
    params = SamplingParams(stop=["stop"], min_tokens=num_first)
    detok, deltas, _ = stream(tokenizer, ids, params)
    assert detok.stop == "stop" and "".join(deltas) == "stop here, then more "


def test_decode_window_stays_small(tokenizer):
    class CountingTokenizer:
        def __init__(self):
            self.max_ids = 0

        def decode(self, ids, skip_special_tokens=False):
            self.max_ids = max(self.max_ids, len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = CountingTokenizer()
    ids = encode(tokenizer, " ".join(TEXTS * 4))
    assert len(ids) > 200
    detok = IncrementalDetokenizer(counting, [], SamplingParams(stop=["never matches"]))
    text = "".join(detok.append(t).delta_text for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert counting.max_ids <= 12


@pytest.mark.parametrize("include", [False, True])
def test_long_stop_strings_hold_back_what_may_start_them(tokenizer, include):
    # The held-back suffix follows the stop strings' own repetitions (a KMP automaton, linear
    # in the text): "ab ab ab" may still become "ab ab ab ab!" until the "!" fails to come.
    stop = " ab" * 40 + "!"
    ids = encode(tokenizer, " ab" * 30 + " c ab ab")
    params = SamplingParams(stop=[stop, " ab ab d"], include_stop_str_in_output=include)
    detok, deltas, stops = stream(tokenizer, ids, params, flush=False)
    text = tokenizer.decode(ids)
    assert set(stops) == {None}
    released = "".join(deltas)
    if include:
        assert released == text  # nothing is held back when the stop is kept in the output
    else:
        # " ab ab" may start either stop string: held; everything before it is out
        assert released == text[: len(text) - len(" ab ab")]
    assert released + detok.flush() == text


def test_stop_prefix_matches_the_quadratic_definition():
    from sparsekv.engine.stop_prefix import StopPrefix

    rng = random.Random(3)
    for _ in range(300):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 8)))
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        tracker, fed = StopPrefix(stop), ""
        for piece in [text[i : i + 3] for i in range(0, len(text), 3)]:
            fed += piece
            expected = max(
                (n for n in range(len(stop)) if n <= len(fed) and fed.endswith(stop[:n])),
                default=0,
            )
            assert tracker.feed(piece) == expected, (stop, fed)
