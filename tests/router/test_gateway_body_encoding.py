"""A compressed request body through the gateway: aiohttp inflates it for parsing, and the worker is sent the
inflated body without the client's Content-Encoding (one consistent request)."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Callable

import pytest

from tests.router.fakes import FakeWorker
from tests.router.harness import GatewayHarness, make_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


@pytest.mark.parametrize(("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_compressed_body_is_forwarded_inflated_without_content_encoding(
    worker: FakeWorker, encoding: str, compress: Callable[[bytes], bytes],
) -> None:
    body = {"model": "m", "prompt": "compressed body " * 4, "max_tokens": 1}
    raw = json.dumps(body).encode()
    async with GatewayHarness(make_config([worker]), workers=[worker]) as h:
        for _ in range(2):
            status, headers, out = await h.post(
                "/v1/completions", None, headers={"Content-Type": "application/json", "Content-Encoding": encoding},
                raw=compress(raw))
            assert status == 200, out
        received = worker.requests[-1]
        assert received["body"] == body
        assert {name.lower() for name in received["headers"]} & {"content-encoding"} == set()
        assert received["headers"]["Content-Length"] == str(len(raw))
        # 64 byte tokens, 4-token blocks: the second request's prediction is the worker's report.
        assert int(headers["x-kvgate-predicted-cached-tokens"]) == json.loads(out)["usage"][
            "prompt_tokens_details"]["cached_tokens"] == 60
        assert h.gw.proxy.num_honesty_mismatches == 0
