"""List-then-watch against a fake Kubernetes API server on 127.0.0.1: the exact worker set after every change."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

pytest.importorskip("kubernetes_asyncio", reason="kubernetes_asyncio not installed (the k8s extra)")

from kubernetes_asyncio import client  # noqa: E402

from router.config import WorkerConfig  # noqa: E402
from router.discovery import PodDiscovery, decode_discovery_config  # noqa: E402
from router.errors import ConfigError, NotFoundError  # noqa: E402
from tests.discovery.fake_apiserver import FakeApiServer, make_pod  # noqa: E402

pytestmark = pytest.mark.integration


class RecordingRegistry:
    """Gateway stand-in with its add_worker/remove_worker contract (duplicate id -> ConfigError, unknown ->
    NotFoundError)."""

    def __init__(self, static_ids: tuple[str, ...] = ()) -> None:
        self.workers: dict[str, WorkerConfig | None] = dict.fromkeys(static_ids)
        self.calls: list[tuple[str, str]] = []

    async def add_worker(self, config: WorkerConfig) -> None:
        if config.id in self.workers:
            raise ConfigError(f"worker: id {config.id!r} already exists")
        self.workers[config.id] = config
        self.calls.append(("add", config.id))

    async def remove_worker(self, worker_id: str) -> None:
        if worker_id not in self.workers:
            raise NotFoundError(f"no worker {worker_id!r}", param="worker_id")
        del self.workers[worker_id]
        self.calls.append(("remove", worker_id))

    def urls(self) -> dict[str, str]:
        return {k: v.url for k, v in self.workers.items() if v is not None}


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.005)


@pytest.fixture
async def server() -> AsyncIterator[FakeApiServer]:
    fake = await FakeApiServer().start()
    yield fake
    await fake.aclose()


@contextlib.asynccontextmanager
async def running(server: FakeApiServer, registry: RecordingRegistry, **overrides: object
                  ) -> AsyncIterator[PodDiscovery]:
    config = decode_discovery_config({"label_selector": "app=worker", "model": "llama", "port": 8000,
                                      "backoff_initial_s": 0.01, "backoff_max_s": 0.02, **overrides})
    configuration = client.Configuration(host=server.url)
    async with client.ApiClient(configuration) as api_client:
        discovery = PodDiscovery(config, registry, client.CoreV1Api(api_client), "llm")
        task = asyncio.create_task(discovery.run())
        try:
            yield discovery
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_list_then_watch_tracks_ready_pods(server):
    server.put(make_pod("w-0", "10.0.0.1"))
    server.put(make_pod("w-1", "10.0.0.2", is_ready=False))
    server.put(make_pod("other", "10.0.0.9", labels={"app": "not-a-worker"}))
    registry = RecordingRegistry()
    async with running(server, registry) as discovery:
        await wait_for(lambda: len(server.watch_requests()) == 1)
        assert registry.urls() == {"w-0": "http://10.0.0.1:8000"}
        assert registry.workers["w-0"].events_endpoint == "tcp://10.0.0.1:5557"
        list_rv = server.list_requests()[0]
        assert list_rv["labelSelector"] == "app=worker"
        assert server.watch_requests()[0]["resourceVersion"] == "103"  # the list's resourceVersion

        server.put(make_pod("w-1", "10.0.0.2"))  # turns Ready
        await wait_for(lambda: "w-1" in registry.workers)
        assert registry.urls() == {"w-0": "http://10.0.0.1:8000", "w-1": "http://10.0.0.2:8000"}

        server.delete("w-0")
        await wait_for(lambda: "w-0" not in registry.workers)
        assert registry.urls() == {"w-1": "http://10.0.0.2:8000"}

        server.put(make_pod("w-1", "10.0.0.3"))  # restarted with a new IP: replaced
        await wait_for(lambda: registry.urls().get("w-1") == "http://10.0.0.3:8000")

        server.put(make_pod("w-1", "10.0.0.3", is_deleting=True))  # terminating: out at once
        await wait_for(lambda: registry.urls() == {})
        assert registry.calls == [("add", "w-0"), ("add", "w-1"), ("remove", "w-0"), ("remove", "w-1"),
                                  ("add", "w-1"), ("remove", "w-1")]
        assert (discovery.num_lists, discovery.num_gone, discovery.num_errors) == (1, 0, 0)
        assert discovery.resource_version == str(server.rv)


async def test_unchanged_pod_update_is_no_fleet_change(server):
    server.put(make_pod("w-0", "10.0.0.1"))
    registry = RecordingRegistry()
    async with running(server, registry) as discovery:
        await wait_for(lambda: len(server.watch_requests()) == 1)
        server.put(make_pod("w-0", "10.0.0.1", labels={"unrelated": "x"}))
        await wait_for(lambda: discovery.resource_version == str(server.rv))
        assert registry.calls == [("add", "w-0")]


async def test_gone_relists_and_reconciles_missed_changes(server):
    server.put(make_pod("w-0", "10.0.0.1"))
    server.put(make_pod("w-1", "10.0.0.2"))
    registry = RecordingRegistry()
    async with running(server, registry) as discovery:
        await wait_for(lambda: len(server.watch_requests()) == 1)
        server.delete("w-0", is_logged=False)  # an event the watch never delivers
        server.put(make_pod("w-2", "10.0.0.4"))
        server.compact()
        await wait_for(lambda: discovery.num_lists == 2 and len(server.watch_requests()) == 2)
        assert registry.urls() == {"w-1": "http://10.0.0.2:8000", "w-2": "http://10.0.0.4:8000"}
        assert (discovery.num_gone, discovery.num_errors) == (1, 0)
        assert server.watch_requests()[1]["resourceVersion"] == str(server.rv)


async def test_watch_end_resumes_from_last_resource_version_without_listing(server):
    server.put(make_pod("w-0", "10.0.0.1"))
    registry = RecordingRegistry()
    async with running(server, registry) as discovery:
        await wait_for(lambda: len(server.watch_requests()) == 1)
        server.put(make_pod("w-1", "10.0.0.2"))
        await wait_for(lambda: "w-1" in registry.workers)
        server.end_watches()
        await wait_for(lambda: len(server.watch_requests()) == 2)
        assert server.watch_requests()[1]["resourceVersion"] == str(server.rv)
        assert discovery.num_lists == 1
        server.put(make_pod("w-2", "10.0.0.3"))
        await wait_for(lambda: "w-2" in registry.workers)
        assert registry.calls == [("add", "w-0"), ("add", "w-1"), ("add", "w-2")]


async def test_failing_lists_back_off_then_recover(server):
    server.put(make_pod("w-0", "10.0.0.1"))
    server.num_failing_lists = 2
    registry = RecordingRegistry()
    async with running(server, registry) as discovery:
        await wait_for(lambda: "w-0" in registry.workers)
        assert (discovery.num_errors, discovery.num_lists) == (2, 1)
        assert len(server.list_requests()) == 3


async def test_unreachable_api_server_is_retried(server):
    registry = RecordingRegistry()
    config = decode_discovery_config({"label_selector": "app=worker", "model": "llama",
                                      "backoff_initial_s": 0.01, "backoff_max_s": 0.01})
    dead_url = server.url
    await server.aclose()  # nothing listens on this port now
    async with client.ApiClient(client.Configuration(host=dead_url)) as api_client:
        discovery = PodDiscovery(config, registry, client.CoreV1Api(api_client), "llm")
        task = asyncio.create_task(discovery.run())
        await wait_for(lambda: discovery.num_errors >= 3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert registry.workers == {}


async def test_worker_ids_it_does_not_own_are_left_alone(server):
    server.put(make_pod("static-0", "10.0.0.1"))
    server.put(make_pod("w-1", "10.0.0.2"))
    registry = RecordingRegistry(static_ids=("static-0",))
    async with running(server, registry) as discovery:
        await wait_for(lambda: len(server.watch_requests()) == 1)
        assert set(discovery.workers) == {"w-1"}
        server.delete("static-0")
        server.delete("w-1")
        await wait_for(lambda: "w-1" not in registry.workers)
        assert "static-0" in registry.workers
        assert registry.calls == [("add", "w-1"), ("remove", "w-1")]


async def test_worker_removed_through_admin_is_tolerated(server):
    server.put(make_pod("w-0", "10.0.0.1"))
    registry = RecordingRegistry()
    async with running(server, registry) as discovery:
        await wait_for(lambda: len(server.watch_requests()) == 1)
        await registry.remove_worker("w-0")  # an operator removed it meanwhile
        server.delete("w-0")
        await wait_for(lambda: discovery.workers == {})
        assert discovery.num_errors == 0
