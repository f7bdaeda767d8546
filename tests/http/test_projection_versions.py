"""one projection-version policy for the message runtime and the HTTP front door.

A key stored under a version of the route's intent is compared under that version when the route
still declares it (``earlier``); when the route no longer declares it, the intents cannot be
compared: the request is never run and never answered with the stored response, but with the
``operation-needs-reconciliation`` problem (409), as the runtime dead-letters such a message as
``needs_reconciliation`` (tests/codec/test_strict_json.py). The same intent under the earlier version
replays; another intent under it is 422.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from consumer_kit import Settings
from consumer_kit.http import Idempotency, IdempotencyPolicy, current_operation
from consumer_kit.http.intent import RequestIntent
from tests.fixtures.harness import fetch_all, throwaway_schema

pytestmark = pytest.mark.postgres

DOCS = "https://api.example/docs/idempotency"
V1 = RequestIntent()  # the whole body


@contextlib.asynccontextmanager
async def route_under(
    database_url: str, schema: str, calls: list[str], *, version: int, earlier: Mapping[int, RequestIntent] | None
) -> AsyncIterator[httpx.AsyncClient]:
    """``POST /pay`` whose intent is projection ``version``: version 2 leaves ``note`` out."""
    settings = Settings(database_url=database_url, db_schema=schema, search_path=schema)
    idempotency = Idempotency(
        settings, client=lambda request: "c-1", policy=IdempotencyPolicy(docs_url=DOCS)
    )

    @idempotency.endpoint(exclude={"note"} if version > 1 else (), projection_version=version, earlier=earlier)
    async def pay(request: Request) -> Response:
        calls.append(f"v{version}")
        await current_operation().connection.execute("INSERT INTO payments (version) VALUES (%s)", (version,))
        return JSONResponse({"paid": True, "under": version}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    async with idempotency.lifespan(app):
        async with idempotency.pool.connection() as conn:
            await conn.execute("CREATE TABLE IF NOT EXISTS payments (version int)")
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield client


async def pay(client: httpx.AsyncClient, key: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post("/pay", json=body, headers={"Idempotency-Key": f'"{key}"'})


@pytest.fixture
async def schema(database_url: str) -> AsyncIterator[str]:
    async with throwaway_schema(database_url, example_tables=False) as name:
        yield name


async def test_a_key_stored_under_a_version_the_route_no_longer_declares_needs_reconciliation(
    database_url: str, schema: str
) -> None:
    calls: list[str] = []
    key, body = str(uuid.uuid4()), {"amount": 10, "note": "first"}
    async with route_under(database_url, schema, calls, version=1, earlier=None) as v1:
        assert (await pay(v1, key, body)).status_code == 201
    async with route_under(database_url, schema, calls, version=2, earlier=None) as v2:
        again = await pay(v2, key, body)
        assert again.status_code == 409
        assert again.json()["type"] == f"{DOCS}#operation-needs-reconciliation"
        assert "idempotent-replayed" not in again.headers  # never answered as a duplicate
    assert calls == ["v1"]  # never run again
    rows = await fetch_all(database_url, schema, "SELECT state, projection_version FROM operations")
    assert rows == [("completed", 1)]  # the stored outcome is left for the operator
    assert await fetch_all(database_url, schema, "SELECT version FROM payments") == [(1,)]


async def test_a_key_stored_under_a_declared_earlier_version_is_compared_under_it(
    database_url: str, schema: str
) -> None:
    calls: list[str] = []
    key, body = str(uuid.uuid4()), {"amount": 10, "note": "first"}
    async with route_under(database_url, schema, calls, version=1, earlier=None) as v1:
        first = await pay(v1, key, body)
    async with route_under(database_url, schema, calls, version=2, earlier={1: V1}) as v2:
        same = await pay(v2, key, body)
        other = await pay(v2, key, {**body, "amount": 11})
    assert same.status_code == 201 and same.content == first.content
    assert same.headers["idempotent-replayed"] == "true"
    assert other.status_code == 422 and other.json()["type"] == f"{DOCS}#idempotency-key-reused"
    assert calls == ["v1"]
