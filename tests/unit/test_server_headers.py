"""``X-Ignored-Fields`` and its log line for names a client chose (``serving.response_headers``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import h11

from sparsekv.server.serving import IGNORED_FIELDS_MAX_CHARS, response_headers


def _header(names: list[str]) -> str:
    return response_headers(SimpleNamespace(ignored_fields=names))["X-Ignored-Fields"]


def _valid_for_h11(value: str) -> None:
    """Raises when h11 (uvicorn without httptools) would refuse the header."""
    h11.Response(status_code=200, headers=[("X-Ignored-Fields", value)])


def test_plain_names_as_they_are_others_json_quoted_and_the_log_line_the_same(caplog):
    names = ["fo\r\nX-Evil: 1", "ключ", "plain_name-1.x", " x", "", "a, b"]
    with caplog.at_level(logging.WARNING, logger="sparsekv.server.serving"):
        value = _header(names)
    assert value == (
        '"fo\\r\\nX-Evil: 1", "\\u043a\\u043b\\u044e\\u0447", plain_name-1.x, " x", "", "a, b"'
    )
    assert all(32 <= ord(c) < 127 for c in value) and value == value.strip()
    _valid_for_h11(value)
    (record,) = caplog.records
    assert record.getMessage() == f"ignored unknown request fields: {value}"


def test_a_long_list_stops_within_the_cap_with_the_count_of_the_rest():
    names = [f"field{i:04d}" for i in range(500)]  # 9 characters each
    value = _header(names)
    assert len(value) <= IGNORED_FIELDS_MAX_CHARS
    head, tail = value.rsplit(", ... (", 1)
    kept = head.split(", ")
    assert kept == names[: len(kept)] and tail == f"{500 - len(kept)} more)"
    assert len(value) + len(", field0000") > IGNORED_FIELDS_MAX_CHARS  # no room for one more
    _valid_for_h11(value)
    assert _header(["x" * 5000]) == "... (1 more)"
    exact = ["y" * (IGNORED_FIELDS_MAX_CHARS - 3), "z"]  # 1024 characters with ", ": all fit
    assert _header(exact) == ", ".join(exact)


def test_no_unknown_fields_no_header():
    assert response_headers(SimpleNamespace(ignored_fields=[])) == {}
