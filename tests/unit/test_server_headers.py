"""``X-Ignored-Fields`` and its log line for names a client chose (``serving.response_headers``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from sparsekv.server.serving import IGNORED_FIELDS_MAX_CHARS, response_headers


def test_names_are_escaped_to_ascii_and_quoted_in_the_log(caplog):
    body = SimpleNamespace(ignored_fields=["fo\r\nX-Evil: 1", "ключ", "plain"])
    with caplog.at_level(logging.WARNING, logger="sparsekv.server.serving"):
        headers = response_headers(body)
    value = headers["X-Ignored-Fields"]
    assert value == "fo\\r\\nX-Evil: 1, \\u043a\\u043b\\u044e\\u0447, plain"
    value.encode("ascii")  # printable ASCII: fits a Latin-1 header
    assert all(32 <= ord(c) < 127 for c in value)
    (record,) = caplog.records
    message = record.getMessage()
    assert "\n" not in message and "\r" not in message
    assert message == ("ignored unknown request fields: 'fo\\r\\nX-Evil: 1', 'ключ', 'plain'")


def test_a_long_list_is_cut_with_the_count_of_the_rest():
    names = [f"field{i:04d}" for i in range(500)]  # 9 characters each, 11 with the separator
    value = response_headers(SimpleNamespace(ignored_fields=names))["X-Ignored-Fields"]
    kept = IGNORED_FIELDS_MAX_CHARS // 11
    assert value == ", ".join(names[:kept] + [f"... ({500 - kept} more)"])
    one_long = response_headers(SimpleNamespace(ignored_fields=["x" * 5000]))
    assert one_long["X-Ignored-Fields"] == "... (1 more)"


def test_no_unknown_fields_no_header():
    assert response_headers(SimpleNamespace(ignored_fields=[])) == {}
