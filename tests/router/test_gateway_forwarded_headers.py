"""The headers a worker is sent when a client repeats its header block with bodies of different lengths: the
gateway reads the block once (``ClientHeaderReader``'s memo leaves ``Content-Length`` out of its key), and every
forwarded request still carries its own body's length."""

from __future__ import annotations

import json

import pytest

from tests.router.fakes import FakeWorker
from tests.router.harness import GatewayHarness, make_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def test_repeated_header_block_is_read_once_and_forwards_each_length(worker: FakeWorker) -> None:
    client_headers = {"Content-Type": "application/json", "User-Agent": "sdk/1.0", "Authorization": "Bearer t",
                      "X-Session-Id": "conv-7"}
    bodies = [json.dumps({"model": "m", "prompt": "p" * num_chars, "max_tokens": 1}).encode()
              for num_chars in (8, 300, 4000)]
    async with GatewayHarness(make_config([worker]), workers=[worker]) as h:
        for raw in bodies:
            status, _, out = await h.post("/v1/completions", None, headers=client_headers, raw=raw)
            assert status == 200, out
        assert len(h.gw.client_headers) == 1  # three POSTs, one block read
        host = worker.url.removeprefix("http://")
        request_ids = [received["headers"]["X-Request-ID"] for received in worker.requests]
        assert len(set(request_ids)) == 3 and all(rid.startswith("kvg-") for rid in request_ids)
        assert len(worker.requests) == 3
        for received, raw, request_id in zip(worker.requests, bodies, request_ids, strict=True):
            # The client's headers in its order (Accept and Accept-Encoding are the test client's own), the
            # gateway's request id, and the forwarded body's own length.
            assert list(received["headers"].items()) == [
                ("Host", host), ("Content-Type", "application/json"), ("User-Agent", "sdk/1.0"),
                ("Authorization", "Bearer t"), ("X-Session-Id", "conv-7"), ("Accept", "*/*"),
                ("Accept-Encoding", "gzip, deflate"), ("X-Request-ID", request_id), ("Content-Length", str(len(raw))),
            ]
            assert json.dumps(received["body"]).encode() == raw
