"""Requests aiohttp's HTTP parser refuses before any handler runs, written byte for byte on a loopback socket: the
answer is a 400 with an OpenAI-style JSON body, the connection is closed, and the log holds one WARNING line
without a traceback (``router.http_server``)."""

from __future__ import annotations

import json
import logging

import pytest

from tests.robustness import raw_http
from tests.router.harness import LoopbackGateway, config_with_overrides

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
BODY = b'{"model": "m", "prompt": "hi"}'


def gateway_config():
    raw = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "models": [{"name": "m", "block_size": 4}],
        "workers": [],
        "policy": {"name": "round_robin"},
        "admin": {"disable_auth": True},
        "health": {"interval_s": 3600},
    }
    return config_with_overrides(raw, {})


async def exchange(port: int, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Write ``request`` as is; read the answer to the end (the gateway closes the connection)."""
    raw = await raw_http.exchange(port, request)
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    headers = {k.decode().lower(): v.decode().strip() for k, _, v in (line.partition(b":") for line in lines)}
    return status_line, headers, body


UNSUPPORTED = "is not supported by this gateway; send the body uncompressed, or as gzip or deflate"
MALFORMED = {
    "content_length_with_transfer_encoding": (
        HEAD + b"Content-Length: 30\r\nTransfer-Encoding: chunked\r\n\r\n" + BODY,
        "malformed HTTP request: Transfer-Encoding can't be present with Content-Length"),
    "brotli_body": (HEAD + b"Content-Encoding: br\r\nContent-Length: 30\r\n\r\n" + BODY,
                    f"the request body's Content-Encoding br {UNSUPPORTED}"),
    "zstd_body": (HEAD + b"Content-Encoding: zstd\r\nContent-Length: 30\r\n\r\n" + BODY,
                  f"the request body's Content-Encoding zstd {UNSUPPORTED}"),
    "space_in_header_name": (HEAD + b"Bad Header: secret\r\nContent-Length: 30\r\n\r\n" + BODY,
                             "malformed HTTP request: Invalid header token"),
    "two_content_lengths": (HEAD + b"Content-Length: 30\r\nContent-Length: 31\r\n\r\n" + BODY,
                            "malformed HTTP request: Duplicate Content-Length"),
    "bad_chunk_size": (HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n",
                       "malformed HTTP request: Invalid character in chunk size"),
    "bad_version": (b"POST /v1/completions HTTP/9.x\r\nHost: a\r\n\r\n", "malformed HTTP request: Bad status line"),
}
"""Request bytes and the message the client gets (the C parser's reasons: aiohttp's llhttp)."""


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_a_request_the_parser_refuses_gets_openai_json_and_one_log_line(case, caplog):
    request, message = MALFORMED[case]
    caplog.set_level(logging.DEBUG)
    async with LoopbackGateway(gateway_config()) as gw:
        status_line, headers, body = await exchange(gw.port, request)
        assert status_line.partition(b" ")[2] == b"400 Bad Request"
        assert headers["content-type"] == "application/json"
        # ``exchange`` read to the end: the gateway closed the connection (an HTTP/1.0 answer: close by default).
        assert int(headers["content-length"]) == len(body)
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "malformed_http")
        assert error["message"] == message
        # The gateway still serves the next connection.
        status_line, _, _ = await exchange(gw.port, b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        assert status_line == b"HTTP/1.1 200 OK"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [(r.name, r.levelname) for r in warnings] == [("router.http_server", "WARNING")]
    assert warnings[0].getMessage() == f"malformed HTTP request from 127.0.0.1 refused (400): {error['message']}"
    assert all(r.exc_info is None and r.exc_text is None for r in caplog.records)
    assert all("secret" not in r.getMessage() for r in caplog.records)


async def test_non_http_bytes_get_the_json_answer_and_only_a_debug_line(caplog):
    caplog.set_level(logging.DEBUG)
    async with LoopbackGateway(gateway_config()) as gw:
        status_line, headers, body = await exchange(gw.port, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n")
        assert status_line.partition(b" ")[2] == b"400 Bad Request"
        assert json.loads(body)["error"]["code"] == "malformed_http"
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert [r.getMessage() for r in caplog.records if r.name == "router.http_server"] == [
        f"non-HTTP bytes from 127.0.0.1 refused: {json.loads(body)['error']['message']}"]
