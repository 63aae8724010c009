"""The real gateway with ``discovery:`` in its config: pods served by a fake API server become admin-visible workers.

Credentials come from a kubeconfig pointing at the fake on 127.0.0.1 (bearer token checked); workers are answered by
a ``MockTransport``, so no request leaves the process except to the fake API server.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

pytest.importorskip("kubernetes_asyncio", reason="kubernetes_asyncio not installed (the k8s extra)")

from router.app import build_app  # noqa: E402
from router.config import parse_config  # noqa: E402
from router.gateway import GATEWAY  # noqa: E402
from router.transport import MockResponse, MockTransport, UpstreamRequest  # noqa: E402
from tests.discovery.fake_apiserver import FakeApiServer, make_pod  # noqa: E402

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "admin-token"
KUBE_TOKEN = "kube-token"


def write_kubeconfig(path: Path, server_url: str) -> None:
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster: {{server: "{server_url}"}}
users:
- name: gateway
  user: {{token: {KUBE_TOKEN}}}
contexts:
- name: fake
  context: {{cluster: fake, user: gateway, namespace: llm}}
current-context: fake
""")


async def answer_healthy(request: UpstreamRequest) -> MockResponse:
    return MockResponse(200, {"Content-Type": "application/json"}, [b"{}"])


async def test_gateway_adds_and_removes_discovered_workers(tmp_path):
    api = await FakeApiServer().start()
    kubeconfig = tmp_path / "kubeconfig"
    write_kubeconfig(kubeconfig, api.url)
    api.put(make_pod("vllm-0", "127.0.0.1", labels={"kvgate.io/model": "llama"},
                     annotations={"kvgate.io/port": "18001"}))
    config = parse_config({
        "models": [{"name": "llama"}],
        "policy": {"name": "round_robin"},
        "admin": {"token": ADMIN_TOKEN},
        "health": {"interval_s": 3600},
        "discovery": {"label_selector": "app=worker", "namespace": "llm", "kubeconfig": str(kubeconfig),
                      "model_label": "kvgate.io/model", "port_annotation": "kvgate.io/port", "events_port": None,
                      "worker": {"load_path": None, "snapshot_path": None}},
    })
    app = build_app(config, transport=MockTransport(answer_healthy))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def worker_urls(session: aiohttp.ClientSession) -> dict[str, str]:
        async with session.get(url + "/admin/workers", headers=headers) as resp:
            assert resp.status == 200
            body = await resp.json()
        return {w["id"]: w["url"] for w in body["workers"]}

    async def wait_for_urls(session: aiohttp.ClientSession, expected: dict[str, str]) -> None:
        async with asyncio.timeout(5):
            while await worker_urls(session) != expected:
                await asyncio.sleep(0.01)

    try:
        async with aiohttp.ClientSession() as session:
            await wait_for_urls(session, {"vllm-0": "http://127.0.0.1:18001"})
            assert app[GATEWAY].fleet.workers["vllm-0"].config.model == "llama"
            api.put(make_pod("vllm-1", "127.0.0.1", labels={"kvgate.io/model": "llama"},
                             annotations={"kvgate.io/port": "18002"}))
            await wait_for_urls(session, {"vllm-0": "http://127.0.0.1:18001", "vllm-1": "http://127.0.0.1:18002"})
            api.delete("vllm-0")
            await wait_for_urls(session, {"vllm-1": "http://127.0.0.1:18002"})
            async with session.get(url + "/v1/models") as resp:
                assert [m["id"] for m in (await resp.json())["data"]] == ["llama"]
    finally:
        await runner.cleanup()
        await api.aclose()
    assert {auth for _, _, auth in api.requests} == {f"Bearer {KUBE_TOKEN}"}
    assert {q["labelSelector"] for _, q, _ in api.requests} == {"app=worker"}
