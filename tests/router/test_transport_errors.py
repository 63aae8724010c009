"""``map_aiohttp_error``: the one table from aiohttp's errors to the gateway's, stage by stage."""

from __future__ import annotations

import aiohttp
import pytest

from router.errors import TransportConnectError, TransportError, TransportTimeoutError
from router.transport import map_aiohttp_error

URL = "http://127.0.0.1:9/v1/completions"


@pytest.mark.parametrize(("exc", "stage", "kind", "message", "is_before_first_byte"), [
    (TimeoutError(), "headers", TransportTimeoutError, "worker w0 timed out before the first byte", True),
    (aiohttp.ServerTimeoutError(), "headers", TransportTimeoutError, "worker w0 timed out before the first byte",
     True),
    (aiohttp.ClientOSError(), "headers", TransportConnectError, "worker w0 unreachable: ClientOSError", True),
    (aiohttp.ServerDisconnectedError(), "headers", TransportConnectError,
     "worker w0 unreachable: ServerDisconnectedError", True),
    (TimeoutError(), "get", TransportTimeoutError, f"GET {URL} timed out", True),
    (aiohttp.ClientOSError(), "get", TransportConnectError, f"GET {URL} failed: ClientOSError", True),
    (TimeoutError(), "body", TransportError, "upstream body broke: TimeoutError()", False),
    (aiohttp.ClientPayloadError("cut"), "body", TransportError, "upstream body broke: ClientPayloadError('cut')",
     False),
])
def test_each_error_maps_to_one_gateway_error(exc, stage, kind, message, is_before_first_byte) -> None:
    got = map_aiohttp_error(exc, stage, "w0", URL)
    assert type(got) is kind
    assert (got.message, got.worker_id, got.endpoint, got.is_before_first_byte) == (
        message, "w0", URL, is_before_first_byte)
