"""The OpenAPI document (``router.openapi``): it validates as OpenAPI 3.1, it is served at ``/openapi.json``, and it
describes exactly the routes the app registers, both ways."""

from __future__ import annotations

import msgspec
import pytest
from openapi_spec_validator import validate

from router.openapi import OPENAPI_PATH, OPERATIONS, app_routes, openapi_document
from tests.router.harness import GatewayHarness, make_config

pytestmark = pytest.mark.unit


def test_document_validates_as_openapi_3_1() -> None:
    document = openapi_document()
    validate(document)
    assert document["openapi"] == "3.1.0"
    assert document["components"]["securitySchemes"]["adminToken"] == {
        "type": "http", "scheme": "bearer", "description": "``admin.token`` (or ``admin.token_env``)."}


def _described(document) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}


def test_every_app_route_is_described_and_every_description_is_a_route() -> None:
    from router.app import build_app

    app = build_app(make_config([]))
    routes = app_routes(app)
    assert routes == _described(openapi_document()), "describe every route in router/openapi.py OPERATIONS"
    assert len(OPERATIONS) == len(routes)
    assert ("GET", "/admin/debug/memory") in routes and ("POST", "/v1/chat/completions") in routes


def test_session_filters_are_described_on_the_listing_and_the_bulk_drop() -> None:
    paths = openapi_document()["paths"]
    filters = ["worker_id", "key_prefix", "min_idle_s", "max_idle_s", "min_age_s"]
    assert [p["name"] for p in paths["/admin/sessions"]["get"]["parameters"]] == ["limit", *filters]
    assert [p["name"] for p in paths["/admin/sessions"]["delete"]["parameters"]] == ["all", *filters]


def test_admin_routes_need_the_token_and_others_do_not() -> None:
    for path, ops in openapi_document()["paths"].items():
        for op in ops.values():
            if path.startswith("/admin/"):
                assert op["security"] == [{"adminToken": []}] and "401" in op["responses"], path
            else:
                assert op["security"] == [] and "401" not in op["responses"], path


def test_schemas_come_from_the_structs() -> None:
    schemas = openapi_document()["components"]["schemas"]
    worker = schemas["WorkerConfig"]
    assert worker["required"] == ["id", "url", "model"] and worker["additionalProperties"] is False
    assert worker["properties"]["dp_rank_offset"] == {"type": "integer", "minimum": 0, "default": 0}
    assert schemas["PolicyConfig"]["discriminator"]["propertyName"] == "name"
    assert schemas["CompletionRequest"]["properties"]["max_tokens"] == {
        "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}], "default": None}
    assert schemas["ErrorResponse"]["properties"]["error"]["required"] == ["message", "type", "param", "code"]


async def test_served_document_equals_the_built_one() -> None:
    async with GatewayHarness(make_config([])) as h:
        assert h.session is not None
        async with h.session.get(h.url + OPENAPI_PATH) as resp:
            assert resp.status == 200 and resp.content_type == "application/json"
            assert msgspec.json.decode(await resp.read()) == openapi_document()
