"""A small fake Kubernetes API server on 127.0.0.1 serving pods as a list and as a watch stream.

It keeps an event log with resourceVersions like the real API server: ``GET /api/v1/namespaces/{ns}/pods`` answers
a ``PodList`` of the pods matching ``labelSelector`` (equality terms only) with the current resourceVersion; with
``watch=true`` it streams, as JSON lines, every logged event after the requested resourceVersion, then new ones as
they happen, until ``timeoutSeconds`` or ``end_watches()``. A watch from a resourceVersion older than the last
``compact()`` gets an ``ERROR`` event with code 410, as the real server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from typing import Any

from aiohttp import web


def make_pod(
    name: str, ip: str = "127.0.0.1", *, is_ready: bool = True, phase: str = "Running",
    labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None, is_deleting: bool = False,
) -> dict[str, Any]:
    """A pod as the API serializes it (camelCase), Ready when ``is_ready``."""
    metadata: dict[str, Any] = {"name": name, "namespace": "llm", "labels": {"app": "worker", **(labels or {})},
                                "annotations": dict(annotations or {})}
    if is_deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": metadata,
        "status": {
            "phase": phase, "podIP": ip,
            "conditions": [{"type": "Initialized", "status": "True"},
                           {"type": "Ready", "status": "True" if is_ready else "False"}],
        },
    }


def _matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeApiServer:
    """Pods of one namespace with an event log; see the module docstring.

    Attributes:
        requests: ``(path, query, authorization header)`` of every request, in order.
        num_failing_lists: the next this many list requests get HTTP 500.
    """

    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.pods: dict[str, dict[str, Any]] = {}
        self.log: list[tuple[int, str, dict[str, Any]]] = []
        self.rv = 100
        self.compacted_rv = 0
        self.requests: list[tuple[str, dict[str, str], str]] = []
        self.num_failing_lists = 0
        self._changed = asyncio.Event()
        self._epoch = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    # -- state changes -----------------------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def put(self, pod: dict[str, Any]) -> None:
        """Create or update a pod (logs ADDED or MODIFIED)."""
        self.rv += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.rv)
        kind = "MODIFIED" if pod["metadata"]["name"] in self.pods else "ADDED"
        self.pods[pod["metadata"]["name"]] = pod
        self.log.append((self.rv, kind, pod))
        self._notify()

    def delete(self, name: str, *, is_logged: bool = True) -> None:
        """Delete a pod (logs DELETED unless ``is_logged`` is false: an event a watcher never sees)."""
        self.rv += 1
        pod = self.pods.pop(name)
        pod["metadata"]["resourceVersion"] = str(self.rv)
        if is_logged:
            self.log.append((self.rv, "DELETED", pod))
        self._notify()

    def compact(self) -> None:
        """Forget history up to now: open watches and watches from an older resourceVersion get 410 Gone."""
        self.compacted_rv = self.rv
        self._notify()

    def end_watches(self) -> None:
        """End every open watch stream cleanly (as a server-side timeout does)."""
        self._epoch += 1
        self._notify()

    def watch_requests(self) -> list[dict[str, str]]:
        """Query parameters of every watch request so far."""
        return [q for _, q, _ in self.requests if q.get("watch") in ("true", "True", "1")]

    def list_requests(self) -> list[dict[str, str]]:
        """Query parameters of every list request so far."""
        return [q for _, q, _ in self.requests if q.get("watch") not in ("true", "True", "1")]

    # -- HTTP --------------------------------------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((request.path, query, request.headers.get("Authorization", "")))
        if request.match_info["namespace"] != self.namespace:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        selector = query.get("labelSelector", "")
        if query.get("watch") in ("true", "True", "1"):
            return await self._watch(request, selector, int(query.get("resourceVersion") or 0),
                                     float(query.get("timeoutSeconds") or 30))
        if self.num_failing_lists > 0:
            self.num_failing_lists -= 1
            return web.json_response({"kind": "Status", "code": 500, "message": "boom"}, status=500)
        items = [p for p in self.pods.values() if _matches(selector, p["metadata"]["labels"])]
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, selector: str, from_rv: int, timeout_s: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):  # the client went away first
            await self._stream_events(resp, selector, from_rv, timeout_s)
        return resp

    async def _stream_events(self, resp: web.StreamResponse, selector: str, from_rv: int, timeout_s: float) -> None:
        epoch = self._epoch
        sent_rv = from_rv
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        while True:
            if self.compacted_rv > from_rv:
                gone = {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                    "reason": "Expired", "message": "too old resource version",
                                                    "code": 410}}
                await resp.write(json.dumps(gone).encode() + b"\n")
                break
            for rv, kind, pod in self.log:
                if rv > sent_rv and _matches(selector, pod["metadata"]["labels"]):
                    await resp.write(json.dumps({"type": kind, "object": pod}).encode() + b"\n")
                    sent_rv = rv
            if self._epoch != epoch:
                break
            changed = self._changed
            try:
                async with asyncio.timeout(max(0.0, deadline_s - loop.time())):
                    await changed.wait()
            except TimeoutError:
                break
        await resp.write_eof()

    async def start(self) -> FakeApiServer:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def aclose(self) -> None:
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
