"""Admin bearer auth: the scheme is case-insensitive (RFC 7235), the token is compared exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.router.fakes import FakeWorker
from tests.router.harness import TOKEN, GatewayHarness, make_config

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

UNAUTHORIZED = {"error": {"message": "missing or wrong admin bearer token", "type": "authentication_error",
                          "param": None, "code": None}}


@pytest.fixture
async def harness() -> AsyncIterator[GatewayHarness]:
    w0 = FakeWorker("w0", with_events=False)
    await w0.start()
    try:
        async with GatewayHarness(make_config([w0])) as h:
            yield h
    finally:
        await w0.stop()


async def get(h: GatewayHarness, path: str, authorization: str | None) -> tuple[int, str, object]:
    assert h.session is not None
    headers = {"Authorization": authorization} if authorization is not None else {}
    async with h.session.get(h.url + path, headers=headers) as resp:
        return resp.status, resp.content_type, await resp.json(content_type=None)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
@pytest.mark.parametrize("path", ["/admin/workers", "/admin/policy"])
async def test_the_scheme_is_case_insensitive(harness, path, scheme):
    status, ctype, body = await get(harness, path, f"{scheme} {TOKEN}")
    assert (status, ctype) == (200, "application/json")
    if path == "/admin/workers":
        assert isinstance(body, dict) and [w["id"] for w in body["workers"]] == ["w0"]


async def test_several_spaces_may_follow_the_scheme(harness):
    status, _, _ = await get(harness, "/admin/workers", f"bearer   {TOKEN}")
    assert status == 200


@pytest.mark.parametrize("authorization", [
    "bearer wrong",
    "Bearer wrong",
    f"bearer {TOKEN}x",
    f"bearer {TOKEN.upper()}",  # the token itself is case-sensitive
    f"Basic {TOKEN}",
    f"Bearer{TOKEN}",
    TOKEN,
    "bearer",
    "",
    None,
])
async def test_a_wrong_or_missing_token_is_a_401(harness, authorization):
    assert await get(harness, "/admin/workers", authorization) == (401, "application/json", UNAUTHORIZED)


@pytest.mark.parametrize(("credentials", "status"), [
    (TOKEN, 200), ("x" * len(TOKEN), 401), (TOKEN[:-1], 401), (TOKEN + "x", 401), ("w", 401)])
async def test_every_bearer_token_is_compared_in_constant_time(harness, monkeypatch, credentials, status):
    """The token goes through ``hmac.compare_digest`` whatever its length or content (no ``==``, no length check
    first, which would let a client time its way to the token); a scheme other than Bearer is refused before."""
    import hmac

    calls: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    got, _, _ = await get(harness, "/admin/workers", f"Bearer {credentials}")
    assert got == status
    assert calls == [(credentials.encode(), TOKEN.encode())]
