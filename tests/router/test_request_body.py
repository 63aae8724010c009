"""Request body parsing: every refusal is the right error, and names the field it is about."""

from __future__ import annotations

import pytest

from router.errors import InvalidFieldError, InvalidJSONError
from router.request_view import parse_request

pytestmark = pytest.mark.unit


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(("kind", "body"), [
    ("completions", b'{"model": "m", "prompt": "x", "junk": ' + nested(5000) + b"}"),  # inside a skipped field
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "junk": ' + nested(5000) + b"}"),
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "x", "junk": ' + nested(5000) + b"}]}"),
    ("completions", b'{"model": "m", "prompt": ' + nested(5000) + b"}"),  # a prompt of any JSON values
])
def test_json_nested_too_deeply_is_invalid_json(kind, body) -> None:
    with pytest.raises(InvalidJSONError) as info:
        parse_request(kind, body)
    assert (info.value.message, info.value.param, info.value.status) == (
        "the request body is not valid JSON: it nests too deeply", None, 400)


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("completions", b"{}", "model"),
    ("chat", b"{}", "model"),
    ("completions", b'{"model": "m"}', "prompt"),
    ("chat", b'{"model": "m"}', "messages"),
    ("chat", b'{"model": "m", "messages": [{}]}', "messages"),  # nested: the top-level field
    ("completions", b'{"model": 1, "prompt": "x"}', "model"),
])
def test_missing_or_wrong_field_is_named(kind, body, param) -> None:
    with pytest.raises(InvalidFieldError) as info:
        parse_request(kind, body)
    assert info.value.param == param


def test_missing_model_message() -> None:
    with pytest.raises(InvalidFieldError) as info:
        parse_request("completions", b"{}")
    assert (info.value.message, info.value.param) == ("Object missing required field `model`", "model")
