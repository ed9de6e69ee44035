"""SamplingParams: defaults, normalization and validation messages."""

from __future__ import annotations

import pytest

from sparsekv.errors import ContextLengthError
from sparsekv.sampling_params import SamplingParams
from sparsekv.server.errors import invalid_request


def test_defaults_validate_and_stop_string_becomes_list():
    params = SamplingParams(stop="###")
    params.validate(max_model_len=2048, num_prompt_tokens=100)
    assert params.stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert not params.is_greedy
    assert SamplingParams(temperature=0.0).is_greedy


def test_list_fields_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []
    stops = ["x"]
    assert SamplingParams(stop=stops).stop is not stops


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("max_tokens", {"max_tokens": -1}),
        ("max_tokens", {"max_tokens": -3}),
        ("max_tokens", {"max_tokens": True}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": float("inf")}),
        ("temperature", {"temperature": "1"}),
        ("top_p", {"top_p": float("nan")}),
        ("repetition_penalty", {"repetition_penalty": float("inf")}),
        ("prompt_logprobs", {"prompt_logprobs": 21}),
        ("prompt_logprobs", {"prompt_logprobs": -1}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("top_k", {"top_k": -2}),
        ("min_p", {"min_p": -0.1}),
        ("min_p", {"min_p": 1.5}),
        ("n", {"n": 0}),
        ("logprobs", {"logprobs": -1}),
        ("logprobs", {"logprobs": 21}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("presence_penalty", {"presence_penalty": -2.1}),
        ("frequency_penalty", {"frequency_penalty": 2.1}),
        ("frequency_penalty", {"frequency_penalty": -3.0}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
        ("stop", {"stop": ["ok", ""]}),
        ("stop", {"stop": ["x"] * 65}),
        ("stop", {"stop": ["x" * 4097]}),
        ("stop_token_ids", {"stop_token_ids": [-5]}),
        ("seed", {"seed": 1.5}),
        ("seed", {"seed": 2**70}),
        ("repetition_penalty", {"repetition_penalty": 1e-45}),
        ("repetition_penalty", {"repetition_penalty": 2e4}),
        ("repetition_penalty", {"repetition_penalty": "2"}),
        ("repetition_penalty", {"repetition_penalty": None}),
        ("presence_penalty", {"presence_penalty": "1"}),
        ("frequency_penalty", {"frequency_penalty": True}),
    ],
)
def test_each_rule_names_its_parameter(name, kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs).validate()
    assert str(info.value).startswith(name)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 0},
        {"top_p": 1.0},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"min_tokens": 16, "max_tokens": 16},
        {"temperature": 0.0},
        {"repetition_penalty": 1e-4},
        {"repetition_penalty": 1e4},
        {"seed": -(2**63)},
        {"seed": 2**63 - 1},
        {"max_tokens": None, "min_tokens": 5},
    ],
)
def test_boundaries_are_accepted(kwargs):
    SamplingParams(**kwargs).validate()


def test_prompt_plus_max_tokens_must_fit_the_context():
    SamplingParams(max_tokens=100).validate(max_model_len=612, num_prompt_tokens=512)
    with pytest.raises(ContextLengthError) as info:  # a ValueError the server tells apart
        SamplingParams(max_tokens=101).validate(max_model_len=612, num_prompt_tokens=512)
    message = str(info.value)
    assert message.startswith("max_tokens")
    assert "512" in message and "612" in message and "101" in message
    with pytest.raises(ValueError, match="^max_tokens"):
        SamplingParams(max_tokens=700).validate(max_model_len=612)


def test_context_errors_are_context_length_exceeded_and_keep_the_renamed_param():
    """The server's 400 for an engine ``ValueError``: ``ContextLengthError`` keeps OpenAI's
    code through chat's renames, any other ``ValueError`` is ``invalid_value``."""
    renames = {"prompt": "messages", "max_tokens": "max_completion_tokens"}
    error = invalid_request(ContextLengthError("prompt: 9 tokens leave no room"), renames)
    assert error.status == 400
    assert error.body()["error"] == {
        "message": "messages: 9 tokens leave no room",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    error = invalid_request(ContextLengthError("max_tokens (9) plus ..."), renames)
    assert (error.param, error.code) == ("max_completion_tokens", "context_length_exceeded")
    error = invalid_request(ValueError("max_tokens must be >= 0, got -1"))
    assert (error.param, error.code) == ("max_tokens", "invalid_value")


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("stop", {"stop": 5}), ("stop_token_ids", {"stop_token_ids": 7})],
)
def test_a_stop_of_the_wrong_type_is_refused_at_construction(name, kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(name)
