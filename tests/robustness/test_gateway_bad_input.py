"""Bad client input and bad admin payloads against a real gateway (127.0.0.1) in front of a real sim worker: every
refusal is an OpenAI-style JSON error with the right status, and nothing is left half-done."""

from __future__ import annotations

import json
from typing import Any

import pytest

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
        for body in (b"", b"{}", b"[5]", b'{"worker_id": "w0"}'):
            status, _, out = await _raw(g, "POST", "/admin/index/clear", body, AUTH)
            assert status == 200, (body, out)
        status, _, out = await _raw(g, "POST", "/admin/index/clear", b'{"worker_id": "nope"}', AUTH)
        assert status == 404 and _is_openai_error(out)
        status, _, out = await _raw(g, "POST", "/v1/completions", b'{"model": "m", "prompt": "ok", "max_tokens": 1}')
        assert status == 200, out
