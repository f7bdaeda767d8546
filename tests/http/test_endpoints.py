"""The HTTP front door on a plain Starlette app (the decorator alone): what is rolled back and
never stored, responses that cannot be stored, an endpoint that ends its own transaction, scopes
of mounted routes, and FastAPI without IdempotentRoute."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from consumer_kit import Settings
from consumer_kit.errors import ConfigurationError
from consumer_kit.http import Idempotency, IdempotencyPolicy, current_operation
from tests.fixtures.harness import fetch_all, throwaway_schema

pytestmark = pytest.mark.postgres

DOCS = "https://api.example/docs/idempotency"


@dataclass
class Served:
    client: httpx.AsyncClient
    schema: str
    database_url: str
    calls: dict[str, int]

    async def post(self, path: str, key: str, body: Any = None) -> httpx.Response:
        return await self.client.post(
            path, json=body if body is not None else {"n": 1},
            headers={"Idempotency-Key": f'"{key}"', "X-Client": "c-1"},
        )

    async def rows(self, query: str) -> list[tuple[Any, ...]]:
        return await fetch_all(self.database_url, self.schema, query)


def build_app(idempotency: Idempotency, calls: dict[str, int]) -> Starlette:
    """Endpoints that each write a row ``notes(path)`` first, then end in their own way."""

    async def note(request: Request) -> None:
        calls[request.url.path] = calls.get(request.url.path, 0) + 1
        await current_operation().connection.execute("INSERT INTO notes (path) VALUES (%s)", (request.url.path,))

    @idempotency.endpoint()
    async def ok(request: Request) -> Response:
        await note(request)
        return JSONResponse({"done": True}, status_code=201, headers={"Set-Cookie": "session=secret"})

    @idempotency.endpoint()
    async def boom(request: Request) -> Response:
        await note(request)
        raise RuntimeError("a bug in the endpoint")

    @idempotency.endpoint()
    async def refuse(request: Request) -> Response:
        await note(request)
        return JSONResponse({"error": "out of stock"}, status_code=409)

    @idempotency.endpoint()
    async def huge(request: Request) -> Response:
        await note(request)
        return Response(b"x" * 2048, media_type="text/plain")

    @idempotency.endpoint()
    async def stream(request: Request) -> Response:
        await note(request)
        return StreamingResponse(iter([b"a", b"b"]))

    @idempotency.endpoint()
    async def commits_itself(request: Request) -> Response:
        await note(request)
        await current_operation().connection.execute("COMMIT; BEGIN")
        return JSONResponse({"done": True})

    routes = [
        Route(f"/{endpoint.__name__}", endpoint, methods=["POST"])
        for endpoint in (ok, boom, refuse, huge, stream, commits_itself)
    ]
    return Starlette(routes=[*routes, Mount("/v2", routes=[Route("/ok", ok, methods=["POST"])])])


@pytest.fixture
async def served(database_url: str) -> AsyncIterator[Served]:
    async with throwaway_schema(database_url, example_tables=False) as schema:
        settings = Settings(database_url=database_url, db_schema=schema, search_path=schema)
        idempotency = Idempotency(
            settings, client=lambda request: request.headers["x-client"],
            policy=IdempotencyPolicy(docs_url=DOCS, max_stored_body_bytes=1024),
        )
        calls: dict[str, int] = {}
        app = build_app(idempotency, calls)
        async with idempotency.lifespan(app):
            async with idempotency.pool.connection() as conn:
                await conn.execute("CREATE TABLE notes (id bigint GENERATED ALWAYS AS IDENTITY, path text)")
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                yield Served(client, schema, database_url, calls)


def key() -> str:
    return str(uuid.uuid4())


async def test_success_is_stored_without_the_cookie_and_replayed(served: Served) -> None:
    k = key()
    first, again = await served.post("/ok", k), await served.post("/ok", k)
    assert first.status_code == again.status_code == 201 and first.content == again.content
    assert first.headers["set-cookie"] == "session=secret"  # the first response is the endpoint's own
    assert "set-cookie" not in again.headers  # never replayed: it belongs to one session
    assert again.headers["idempotent-replayed"] == "true"
    assert served.calls["/ok"] == 1 and await served.rows("SELECT path FROM notes") == [("/ok",)]


async def test_an_unhandled_exception_rolls_back_and_the_retry_runs_again(served: Served) -> None:
    k = key()
    assert (await served.post("/boom", k)).status_code == 500
    assert (await served.post("/boom", k)).status_code == 500
    assert served.calls["/boom"] == 2  # not stored: the retry ran the endpoint again
    assert await served.rows("SELECT * FROM notes") == []
    assert await served.rows("SELECT * FROM operations") == []


async def test_a_4xx_the_endpoint_returns_is_rolled_back_and_not_stored(served: Served) -> None:
    k = key()
    first, again = await served.post("/refuse", k), await served.post("/refuse", k)
    assert first.status_code == again.status_code == 409
    assert "idempotent-replayed" not in again.headers
    assert served.calls["/refuse"] == 2
    assert await served.rows("SELECT * FROM notes") == []
    assert await served.rows("SELECT * FROM operations") == []


@pytest.mark.parametrize("path", ["/huge", "/stream"])
async def test_a_response_that_cannot_be_stored_is_rolled_back(served: Served, path: str) -> None:
    response = await served.post(path, key())
    assert response.status_code == 500
    assert response.json()["type"] == f"{DOCS}#response-not-storable"
    assert await served.rows("SELECT * FROM notes") == []
    assert await served.rows("SELECT * FROM operations") == []


async def test_an_endpoint_that_commits_itself_is_parked_never_run_again(served: Served) -> None:
    k = key()
    parked = await served.post("/commits_itself", k)
    assert parked.status_code == 500
    assert parked.json()["type"] == f"{DOCS}#operation-needs-reconciliation"
    again = await served.post("/commits_itself", k)
    assert again.status_code == 409 and again.json()["type"] == f"{DOCS}#operation-needs-reconciliation"
    assert served.calls["/commits_itself"] == 1
    assert await served.rows("SELECT state FROM operations") == [("needs_reconciliation",)]


async def test_the_mount_prefix_is_part_of_the_scope(served: Served) -> None:
    k = key()
    assert (await served.post("/ok", k)).status_code == 201
    assert (await served.post("/v2/ok", k)).status_code == 201  # another route: not a replay
    assert sorted(await served.rows("SELECT scope FROM operations")) == [
        ("c-1/POST /ok/v1",), ("c-1/POST /v2/ok/v1",),
    ]


async def test_fastapi_without_idempotent_route_refuses_to_run_unprotected(database_url: str) -> None:
    idempotency = Idempotency(
        Settings(database_url=database_url), client=lambda request: "c", policy=IdempotencyPolicy(docs_url=DOCS)
    )
    app = FastAPI()

    @app.post("/x")  # the default APIRoute: nothing would run the protocol
    @idempotency.endpoint()
    async def unprotected() -> dict[str, bool]:
        return {"ran": True}

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        with pytest.raises(ConfigurationError, match="route_class"):
            await client.post("/x", headers={"Idempotency-Key": f'"{key()}"'})
