"""Bad client input and bad admin payloads against a real gateway (127.0.0.1) in front of a real sim worker: every
refusal is an OpenAI-style JSON error with the right status, and nothing is left half-done."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xxhash

from tests.robustness import raw_http
from tests.router.sim_fleet import MODEL, TOKEN, Gw, SimWorker, free_port, make_config, running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _raw(g: Gw, method: str, path: str, data: bytes, headers: dict[str, str] | None = None,
               ) -> tuple[int, str, Any]:
    assert g.session is not None
    async with g.session.request(method, g.url + path, data=data, headers=headers) as resp:
        return resp.status, resp.content_type, await resp.json(content_type=None)


def _is_openai_error(body: Any) -> bool:
    return isinstance(body, dict) and set(body.get("error", {})) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("prompt", [b"[[]]", b'[["a", "b"]]', b'[["a"]]', b"[[1, []]]"])
async def test_completions_prompt_nested_lists_are_refused_with_400(prompt: bytes) -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        body = b'{"model": "m", "max_tokens": 2, "prompt": ' + prompt + b"}"
        status, ctype, out = await _raw(g, "POST", "/v1/completions", body)
        assert status == 400, out
        assert ctype == "application/json" and _is_openai_error(out)
        assert out["error"]["param"] == "prompt"
        status, _, out = await _raw(g, "POST", "/v1/completions", b'{"model": "m", "prompt": "ok", "max_tokens": 1}')
        assert status == 200, out


async def test_chat_content_part_of_wrong_type_names_the_field() -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        body = b'{"model": "m", "messages": [{"role": "user", "content": ["hi"]}]}'
        status, _, out = await _raw(g, "POST", "/v1/chat/completions", body)
        assert status == 400 and _is_openai_error(out)
        assert out["error"]["param"] == "messages"
        assert "messages" in out["error"]["message"]
        assert "body must be a JSON object" not in out["error"]["message"]


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_wrong_method_and_unknown_path_get_json_errors(method: str) -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        status, ctype, out = await _raw(g, method, "/v1/completions", b"")
        assert status == 405 and ctype == "application/json" and _is_openai_error(out), out
        status, ctype, out = await _raw(g, "POST", "/v1/no-such-route", b"{}")
        assert status == 404 and ctype == "application/json" and _is_openai_error(out), out


@pytest.mark.parametrize("endpoint", ["garbage", "tcp://127.0.0.1:notaport"])
async def test_admin_add_worker_with_bad_events_endpoint_is_400_and_adds_nothing(endpoint: str) -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        entry = {"id": "bad", "url": f"http://127.0.0.1:{free_port()}", "model": MODEL, "events_endpoint": endpoint}
        status, _, out = await _raw(g, "POST", "/admin/workers", json.dumps(entry).encode(), AUTH)
        assert status == 400 and _is_openai_error(out), out
        status, _, listed = await _raw(g, "GET", "/admin/workers", b"", AUTH)
        assert [w["id"] for w in listed["workers"]] == ["w0"]
        assert "bad" not in g.gw.fleet.workers and "bad" not in g.gw.subscriber._specs
        # the same id can be added once the payload is right
        good = {**entry, "events_endpoint": None}
        status, _, out = await _raw(g, "POST", "/admin/workers", json.dumps(good).encode(), AUTH)
        assert status == 201, out


@pytest.mark.parametrize("url", ["http://", "http://:8000", "http://127.0.0.1:notaport", "https:///v1"])
async def test_admin_add_worker_url_without_host_or_with_bad_port_is_400(url: str) -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        entry = {"id": "bad", "url": url, "model": MODEL}
        status, _, out = await _raw(g, "POST", "/admin/workers", json.dumps(entry).encode(), AUTH)
        assert status == 400 and _is_openai_error(out), out
        assert "bad" not in g.gw.fleet.workers


async def test_admin_index_clear_with_a_never_indexed_worker() -> None:
    """A worker without events (approximate mode, nothing indexed yet) must not break a fleet-wide clear."""
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        for body in (b"", b"{}", b'{"worker_id": "w0"}'):
            status, _, out = await _raw(g, "POST", "/admin/index/clear", body, AUTH)
            assert status == 200, (body, out)
        status, _, out = await _raw(g, "POST", "/admin/index/clear", b'{"worker_id": "nope"}', AUTH)
        assert status == 404 and _is_openai_error(out)
        status, _, out = await _raw(g, "POST", "/v1/completions", b'{"model": "m", "prompt": "ok", "max_tokens": 1}')
        assert status == 200, out


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/completions", b'{"model": "m", "prompt": "x", "junk": ' + _nested(5000) + b"}"),
    ("POST", "/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "junk": ' + _nested(5000) + b"}"),
    ("POST", "/admin/workers", _nested(5000)),
    ("POST", "/admin/index/clear", _nested(5000)),
    ("PUT", "/admin/policy", b'{"x": ' + _nested(5000) + b', "name": "cache_aware"}'),
])
async def test_json_nested_too_deeply_is_a_400_json_error(method: str, path: str, body: bytes) -> None:
    """msgspec gives up at the interpreter's recursion limit (about 1,000 levels; 10 KB of brackets here)."""
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        status, ctype, out = await _raw(g, method, path, body, {**AUTH, "Content-Type": "application/json"})
        assert (status, ctype) == (400, "application/json") and _is_openai_error(out), out
        assert out["error"] == {"message": "the request body is not valid JSON: it nests too deeply",
                                "type": "invalid_request_error", "param": None, "code": None}
        status, _, out = await _raw(g, "POST", "/v1/completions", b'{"model": "m", "prompt": "ok", "max_tokens": 1}')
        assert status == 200, out


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b"{}", "model"),
    ("/v1/chat/completions", b"{}", "model"),
    ("/v1/completions", b'{"model": "m"}', "prompt"),
    ("/v1/chat/completions", b'{"model": "m"}', "messages"),
])
async def test_missing_field_is_named_in_param(path: str, body: bytes, param: str) -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        status, _, out = await _raw(g, "POST", path, body)
        assert status == 400 and _is_openai_error(out), out
        assert (out["error"]["param"], out["error"]["message"]) == (
            param, f"Object missing required field `{param}`")


async def _raw_http(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], Any]:
    """One HTTP/1.1 exchange written byte for byte (header values no client library would send); the JSON answer.

    ``head`` is the request line and headers without the blank line; ``Connection: close`` and the body's length
    are added.
    """
    data = await raw_http.exchange(
        port, head + b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    response_head, _, response_body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = response_head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split(" ")[1]), headers, json.loads(response_body)


@pytest.mark.parametrize("authorization", [b"Bearer \xff", b"Bearer " + TOKEN.encode() + b"\xe9", b"\xff\xfe"])
@pytest.mark.parametrize("path", [b"/admin/workers", b"/admin/policy", b"/admin/index", b"/admin/sessions"])
async def test_non_utf8_authorization_is_a_401(path: bytes, authorization: bytes) -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        status, headers, out = await _raw_http(g.port, b"GET " + path + b" HTTP/1.1\r\nhost: gw\r\n"
                                               + b"authorization: " + authorization)
        assert (status, headers["content-type"]) == (401, "application/json")
        assert out["error"] == {"message": "missing or wrong admin bearer token", "type": "authentication_error",
                                "param": None, "code": None}
        status, _, _ = await _raw_http(g.port, b"GET " + path + b" HTTP/1.1\r\nhost: gw\r\n"
                                       + b"authorization: Bearer " + TOKEN.encode())
        assert status == 200


async def test_non_ascii_token_matches_its_utf8_bytes() -> None:
    token = "t\u00f6ken"
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws, admin={"token": token})) as g:
        head = b"GET /admin/workers HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer "
        status, _, _ = await _raw_http(g.port, head + token.encode("utf-8"))
        assert status == 200
        status, _, out = await _raw_http(g.port, head + token.encode("latin-1"))  # t\xf6ken: not the token
        assert status == 401 and out["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("method", "path"), [("POST", "/admin/workers"), ("POST", "/admin/index/clear"),
                                              ("PUT", "/admin/policy"), ("POST", "/v1/completions"),
                                              ("POST", "/v1/chat/completions")])
async def test_admin_body_that_does_not_inflate_is_a_400_json_error(method: str, path: str) -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        status, ctype, out = await _raw(g, method, path, b"not gzip",
                                        {**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert (status, ctype) == (400, "application/json") and _is_openai_error(out), out
        assert out["error"]["type"] == "invalid_request_error"
        assert out["error"]["message"] == "the request body could not be read: Can not decode content-encoding: gzip"


_COMPLETION = json.dumps({"model": MODEL, "prompt": "session key probe " * 3, "max_tokens": 1}).encode()


def _hashed(prefix: str, raw: bytes) -> str:
    """The key ``derive_session_key`` gives a header value that is not valid UTF-8 (see policies.sticky)."""
    return prefix + "#" + xxhash.xxh3_128_hexdigest(raw.decode("utf-8", "surrogateescape").encode(
        "utf-8", "surrogatepass"))


@pytest.mark.parametrize(("header", "key"), [
    (b"x-session-id: " + b"\xff" * 300, _hashed("sid", b"\xff" * 300)),
    (b"x-session-id: \xff\xfe", _hashed("sid", b"\xff\xfe")),
    (b"x-smg-routing-key: caf\xe9", _hashed("smg", b"caf\xe9")),
    (b"x-smg-routing-key: caf\xc3\xa9", "smg:caf\u00e9"),
])
@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_non_utf8_session_header_is_a_stable_hashed_key(
    header: bytes, key: str, store: str, request: pytest.FixtureRequest,
) -> None:
    """aiohttp carries a header's non-UTF-8 bytes as lone surrogates; the session key derived from them is hashed,
    so it is valid UTF-8 for every store (redis-py encodes keys strictly) and for ``/admin/sessions``."""
    sessions: dict[str, Any] = {"store": store}
    if store == "redis":
        sessions.update(url=request.getfixturevalue("redis_url"),
                        key_prefix=request.getfixturevalue("redis_key_prefix"))
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(
            ws, policy={"name": "session_sticky"}, sessions=sessions)) as g:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n" + header
        for _ in range(2):
            status, headers, out = await _raw_http(g.port, head, _COMPLETION)
            assert status == 200, out
            assert headers["x-kvgate-worker"] == "w0"
        entries = await g.gw.sessions.list_sessions(10)
        assert [e.session_key for e in entries] == [key]
        status, _, listed = await _raw(g, "GET", "/admin/sessions", b"", AUTH)
        assert status == 200
        assert [s["session_key"] for s in listed["sessions"]] == [key]
        assert listed["num_sessions"] == 1


async def test_non_utf8_long_session_header_with_a_stateless_policy() -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        head = (b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"x-session-id: " + b"\xff" * 300)
        status, _, out = await _raw_http(g.port, head, _COMPLETION)
        assert status == 200, out


async def test_a_body_that_stalls_gets_408_and_releases_its_slot() -> None:
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(
            ws, listen={"host": "127.0.0.1", "port": 0, "body_timeout_s": 0.3})) as g:
        data = await raw_http.exchange(g.port, b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: "
                                       b"application/json\r\ncontent-length: 100\r\n\r\n{\"model\": ",
                                       max_bytes=65536)  # 10 of the 100 bytes, then nothing
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        error = json.loads(body)["error"]
        assert (error["type"], error["message"]) == ("invalid_request_error",
                                                     "the request body did not arrive within 0.3 s")
        assert g.gw.admission.num_inflight == 0
        status, _, _ = await g.post("/v1/completions", {"model": MODEL, "prompt": "still serving"})
        assert status == 200


@pytest.mark.parametrize("path", ["/admin/sessions", "/admin/decisions", "/admin/debug/memory"])
@pytest.mark.parametrize("value", ["false", "", "1.5", "ten"])
async def test_admin_limit_that_is_not_an_integer_is_400_naming_it(path: str, value: str) -> None:
    # Found by the API fuzzer (benchmarks.api_fuzz): ``?limit=false`` used to answer 200 with the default limit.
    async with running(SimWorker("w0", with_events=False)) as ws, Gw(make_config(ws)) as g:
        status, ctype, out = await _raw(g, "GET", f"{path}?limit={value}", b"", AUTH)
        assert status == 400 and ctype == "application/json" and _is_openai_error(out), out
        assert out["error"]["param"] == "limit"
        assert out["error"]["message"] == f"limit must be an integer, got {value!r}"
        status, _, out = await _raw(g, "GET", f"{path}?limit=0", b"", AUTH)  # out of range: clamped, as before
        assert status == 200, out
