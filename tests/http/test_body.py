"""The HTTP front door's body limit: ``IdempotencyPolicy.max_body_bytes`` is checked
against ``Content-Length`` and while a chunked body streams in, answered ``413`` problem+json before
any lookup (no ledger row, the endpoint not run); a body exactly at the limit is served; a large
body is parsed and fingerprinted off the event loop (another coroutine runs meanwhile)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from consumer_kit import Settings
from consumer_kit.errors import ConfigurationError
from consumer_kit.http import Idempotency, IdempotencyPolicy, current_operation
from consumer_kit.http.body import DEFAULT_MAX_BODY_BYTES, OFF_LOOP_BYTES
from consumer_kit.http.intent import RequestIntent, RequestParts
from tests.fixtures.harness import fetch_all, throwaway_schema

pytestmark = pytest.mark.postgres

DOCS = "https://api.example/docs/idempotency"
LIMIT = 1024


@asynccontextmanager
async def serving(database_url: str, max_body_bytes: int) -> AsyncIterator[tuple[httpx.AsyncClient, str, list[int]]]:
    """A Starlette app with one idempotent endpoint that counts its calls and echoes the body size."""
    async with throwaway_schema(database_url, example_tables=False) as schema:
        settings = Settings(database_url=database_url, db_schema=schema, search_path=schema)
        idempotency = Idempotency(
            settings, client=lambda request: "c-1",
            policy=IdempotencyPolicy(docs_url=DOCS, max_body_bytes=max_body_bytes),
        )
        calls: list[int] = []

        @idempotency.endpoint()
        async def orders(request: Request) -> Response:
            body = await request.body()  # the endpoint reads the body again, as FastAPI does
            calls.append(len(body))
            await current_operation().connection.execute("SELECT 1")
            return JSONResponse({"bytes": len(body)}, status_code=201)

        app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
        async with idempotency.lifespan(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
                yield client, schema, calls


def headers() -> dict[str, str]:
    return {"Idempotency-Key": f'"{uuid.uuid4()}"', "Content-Type": "application/json"}


def json_of_exactly(size: int) -> bytes:
    """A JSON object of exactly ``size`` bytes (trailing whitespace is JSON)."""
    core = b'{"n": 1}'
    return core + b" " * (size - len(core))


def assert_too_large(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["type"] == f"{DOCS}#request-body-too-large" and problem["status"] == 413
    assert str(LIMIT) in problem["detail"]


def test_the_limit_is_bytes_in_a_range_and_published() -> None:
    assert IdempotencyPolicy(docs_url=DOCS).max_body_bytes == DEFAULT_MAX_BODY_BYTES == 4 * 1024 * 1024
    assert IdempotencyPolicy(docs_url=DOCS, max_body_bytes=LIMIT).describe()["request_body_max_bytes"] == LIMIT
    for wrong in (-1, 2**30 + 1):
        with pytest.raises(ConfigurationError, match="max_body_bytes"):
            IdempotencyPolicy(docs_url=DOCS, max_body_bytes=wrong)


async def test_a_body_over_the_limit_by_content_length_is_413_before_any_lookup(database_url: str) -> None:
    async with serving(database_url, LIMIT) as (client, schema, calls):
        response = await client.post("/orders", content=json_of_exactly(LIMIT + 1), headers=headers())
        assert response.request.headers["content-length"] == str(LIMIT + 1)
        rows = await fetch_all(database_url, schema, "SELECT count(*) FROM operations")
    assert_too_large(response)
    assert "Content-Length" in response.json()["detail"]
    assert calls == [] and rows == [(0,)]


async def test_a_chunked_body_over_the_limit_is_413_while_it_streams(database_url: str) -> None:
    sent: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        body = json_of_exactly(LIMIT * 4)
        for start in range(0, len(body), 256):
            sent.append(start)
            yield body[start:start + 256]

    async with serving(database_url, LIMIT) as (client, schema, calls):
        response = await client.post("/orders", content=chunks(), headers=headers())
        assert "content-length" not in response.request.headers
        assert response.request.headers["transfer-encoding"] == "chunked"
        rows = await fetch_all(database_url, schema, "SELECT count(*) FROM operations")
    assert_too_large(response)
    assert calls == [] and rows == [(0,)]


async def test_a_body_exactly_at_the_limit_is_served_chunked_or_not(database_url: str) -> None:
    body = json_of_exactly(LIMIT)

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 100):
            yield body[start:start + 100]

    async with serving(database_url, LIMIT) as (client, schema, calls):
        plain = await client.post("/orders", content=body, headers=headers())
        chunked = await client.post("/orders", content=chunks(), headers=headers())
        rows = await fetch_all(database_url, schema, "SELECT state FROM operations")
    assert (plain.status_code, plain.json()) == (201, {"bytes": LIMIT})
    assert (chunked.status_code, chunked.json()) == (201, {"bytes": LIMIT})
    assert calls == [LIMIT, LIMIT] and rows == [("completed",), ("completed",)]


async def test_a_large_body_is_fingerprinted_while_another_coroutine_makes_progress(
    database_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ticks = 0
    during: list[int] = []
    real: Callable[[RequestIntent, RequestParts], str] = RequestIntent.fingerprint

    def observed(intent: RequestIntent, parts: RequestParts) -> str:  # the real one, with the ticker read around it
        before = ticks
        try:
            return real(intent, parts)
        finally:
            during.append(ticks - before)

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    monkeypatch.setattr(RequestIntent, "fingerprint", observed)
    items = [{"sku": f"sku-{i:07d}", "quantity": i % 97, "note": "x" * 40} for i in range(45_000)]
    body = json.dumps({"n": 1, "items": items}).encode()
    assert 4_000_000 < len(body) <= DEFAULT_MAX_BODY_BYTES and len(body) > OFF_LOOP_BYTES
    async with serving(database_url, DEFAULT_MAX_BODY_BYTES) as (client, _schema, calls):
        counting = asyncio.create_task(ticker())
        try:
            response = await client.post("/orders", content=body, headers=headers())
        finally:
            counting.cancel()
    assert response.status_code == 201, response.text
    assert calls == [len(body)]
    assert len(during) == 1 and during[0] > 0, during  # the ticker ran while the 4 MB body was fingerprinted
