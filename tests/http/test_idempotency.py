"""the HTTP front door of the invoices example (examples/invoices/api.py), through httpx
against the real ASGI app and the real PostgreSQL.

Draft sections cited: draft-ietf-httpapi-idempotency-key-header-07.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from consumer_kit import Settings
from consumer_kit.demo.api import create_app
from consumer_kit.errors import SimulatedCrash
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from tests.fixtures.harness import fetch_all, throwaway_schema

pytestmark = pytest.mark.postgres

TOKENS = {"token-a": "client-a", "token-b": "client-b"}


def command(amount: int = 1250, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "order_id": 418, "revision": 2, "customer_id": "c-1", "amount_cents": amount, "currency": "EUR",
        "requested_at": "2026-03-01T10:00:00+00:00",
    }
    body.update(changes)
    return body


def new_key() -> str:
    return str(uuid.uuid4())


@dataclass
class Api:
    """One test's API: an httpx client on the ASGI app, its schema and database."""

    client: httpx.AsyncClient
    schema: str
    database_url: str

    async def post(
        self, key: str | None, body: dict[str, Any] | None = None, *, token: str = "token-a",
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        sent = {"Authorization": f"Bearer {token}", **(headers or {})}
        if key is not None:
            sent["Idempotency-Key"] = f'"{key}"'
        return await self.client.post("/invoices", json=command() if body is None else body, headers=sent)

    async def rows(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        return await fetch_all(self.database_url, self.schema, query, *params)


@asynccontextmanager
async def serving(database_url: str, schema: str, **settings: Any) -> AsyncIterator[Api]:
    """The example API on ``schema`` (lifespan run), with an httpx client on it."""
    app = create_app(
        Settings(database_url=database_url, db_schema=schema, search_path=schema, **settings), tokens=TOKENS
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield Api(client, schema, database_url)


@pytest.fixture
async def schema(database_url: str) -> AsyncIterator[str]:
    async with throwaway_schema(database_url, example_tables=False) as name:
        yield name


@pytest.fixture
async def api(database_url: str, schema: str) -> AsyncIterator[Api]:
    async with serving(database_url, schema, pool_size=24, lock_timeout=30.0) as served:
        yield served


def assert_problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    """An RFC 9457 problem of type ``<docs>#<slug>`` with the draft's Link to the docs."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["link"] == '</docs/idempotency>; rel="describedby"; type="text/html"'
    problem: dict[str, Any] = response.json()
    assert problem["type"] == f"/docs/idempotency#{slug}"
    assert problem["status"] == status and problem["title"] and problem["detail"]
    return problem


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


async def effects(api: Api) -> list[tuple[Any, ...]]:
    return await api.rows("SELECT client_id, operation_key, amount_cents FROM invoice_requests ORDER BY request_id")


@asynccontextmanager
async def table_locked(database_url: str, schema: str) -> AsyncIterator[None]:
    """Hold an EXCLUSIVE lock on ``invoice_requests``: the endpoint's INSERT waits, after its
    claim, inside its transaction, until the block ends."""
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        await conn.execute(
            sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(sql.Identifier(schema, "invoice_requests"))
        )
        yield
        await conn.rollback()


async def until(condition: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    """Wait until ``condition()`` holds (polled), at most ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not await condition():
            await asyncio.sleep(0.02)


async def waiting_on_table(api: Api) -> int:
    """Sessions waiting for the lock on this schema's ``invoice_requests`` (the endpoint's INSERT)."""
    (row,) = await api.rows(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass(%s)",
        f"{api.schema}.invoice_requests",
    )
    return int(row[0])


async def waiting_on_claim(api: Api) -> int:
    """Sessions whose claim on this schema's ledger waits for another transaction."""
    (row,) = await api.rows(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
        f'%"{api.schema}"."operations"%',
    )
    return int(row[0])


# -- the draft's enforcement scenarios (section 2.6) ----------------------------------------------


async def test_same_request_three_times_is_one_effect_and_three_identical_responses(api: Api) -> None:
    key = new_key()
    first = await api.post(key)
    second = await api.post(key)
    third = await api.post(key, command(requested_at="2031-05-01T10:00:00+02:00"))  # volatile field only
    assert first.status_code == second.status_code == third.status_code == 202
    assert first.content == second.content == third.content
    for header in ("content-type", "location"):
        assert first.headers[header] == second.headers[header] == third.headers[header]
    assert [replayed(r) for r in (first, second, third)] == [False, True, True]
    assert first.json()["operation_key"] == key
    assert await effects(api) == [("client-a", key, 1250)]
    # the ledger row holds the response; the one outbox row carries the operation's identity
    assert await api.rows("SELECT scope, key, state, result_status FROM operations") == [
        ("client-a/POST /invoices/v1", key, "completed", "202")
    ]
    (event,) = await api.rows("SELECT destination, operation_scope, operation_key, headers FROM outbox")
    assert event[:3] == ("invoices.commands", "client-a/POST /invoices/v1", key)
    assert event[3]["operation-id"] == key and event[3]["tenant-id"] == "client-a"


async def test_twenty_concurrent_identical_requests_are_one_effect(api: Api) -> None:
    key = new_key()
    async with table_locked(api.database_url, api.schema):
        requests = [asyncio.create_task(api.post(key)) for _ in range(20)]
        # one request claimed and waits on the table inside its transaction; the other 19 wait on
        # its claim: all 20 are in flight at once before the first may finish
        await until(lambda: _equals(waiting_on_table(api), 1))
        await until(lambda: _equals(waiting_on_claim(api), 19))
    responses = await asyncio.gather(*requests)
    executed = [r for r in responses if r.status_code == 202 and not replayed(r)]
    assert len(executed) == 1
    for response in responses:
        if response.status_code == 409:
            assert_problem(response, 409, "request-outstanding")
            assert response.headers["retry-after"] == "1"
        else:
            assert response.status_code == 202 and response.content == executed[0].content
    assert await effects(api) == [("client-a", key, 1250)]
    assert len(await api.rows("SELECT 1 FROM outbox")) == 1


async def test_a_retry_while_the_first_runs_is_409_with_retry_after(api: Api, database_url: str) -> None:
    key = new_key()
    async with serving(database_url, api.schema, lock_timeout=0.2) as impatient:
        async with table_locked(database_url, api.schema):
            first = asyncio.create_task(api.post(key))
            await until(lambda: _equals(waiting_on_table(api), 1))
            retry = await impatient.post(key)
        assert (await first).status_code == 202
    assert_problem(retry, 409, "request-outstanding")
    assert retry.headers["retry-after"] == "1"
    after = await api.post(key)  # once the first is done, the same retry is its replay
    assert after.status_code == 202 and replayed(after) and after.content == (await first).content
    assert len(await effects(api)) == 1


async def test_another_payload_under_the_key_is_422_and_no_effect(api: Api) -> None:
    key = new_key()
    assert (await api.post(key)).status_code == 202
    reused = await api.post(key, command(amount=9999))
    assert_problem(reused, 422, "idempotency-key-reused")
    assert await effects(api) == [("client-a", key, 1250)]
    assert len(await api.rows("SELECT 1 FROM outbox")) == 1


# -- errors before any lookup (sections 2.1, 2.7, 5) ------------------------------------------------


async def test_a_missing_key_is_400_and_nothing_runs(api: Api) -> None:
    response = await api.post(None)
    assert_problem(response, 400, "idempotency-key-missing")
    assert await effects(api) == []
    assert await api.rows("SELECT 1 FROM operations") == []


@pytest.mark.parametrize(
    "field",
    [
        "8e03978e-40d5-43e8-bc93-6894a57f9324",  # not an sf-string
        '"short"',  # below the published format
        '"8e03978e-40d5-43e8-bc93-6894a57f9324";v=1',  # parameters
        '"8e03978e-40d5-43e8-bc93-6894a57f9324", "9e03978e-40d5-43e8-bc93-6894a57f9324"',  # a list
        "\"' OR '1'='1' --\"",  # injection attempt
    ],
)
async def test_a_malformed_key_is_refused_before_any_lookup(api: Api, field: str) -> None:
    response = await api.post(None, headers={"Idempotency-Key": field})
    problem = assert_problem(response, 400, "idempotency-key-malformed")
    assert "OR '1'" not in problem["detail"]
    assert await api.rows("SELECT 1 FROM operations") == []
    assert await effects(api) == []


async def test_two_key_fields_are_refused(api: Api) -> None:
    key = new_key()
    response = await api.client.post(
        "/invoices", json=command(),
        headers=[("Authorization", "Bearer token-a"), ("Idempotency-Key", f'"{key}"'), ("Idempotency-Key", f'"{key}"')],
    )
    assert_problem(response, 400, "idempotency-key-malformed")
    assert await api.rows("SELECT 1 FROM operations") == []


async def test_a_body_without_one_meaning_is_400_before_any_lookup(api: Api) -> None:
    response = await api.client.post(
        "/invoices", content=b'{"order_id": 418, "order_id": 419}',
        headers={"Authorization": "Bearer token-a", "Idempotency-Key": f'"{new_key()}"',
                 "Content-Type": "application/json"},
    )
    assert_problem(response, 400, "request-body-invalid")
    assert await api.rows("SELECT 1 FROM operations") == []


# -- scope (section 5): client + method + route + API version ---------------------------------------


async def test_keys_of_two_clients_never_collide(api: Api) -> None:
    key = new_key()
    a = await api.post(key, command(amount=100), token="token-a")
    b = await api.post(key, command(amount=200), token="token-b")  # same key, other payload: no 422
    assert a.status_code == b.status_code == 202 and not replayed(a) and not replayed(b)
    assert a.json()["request_id"] != b.json()["request_id"]
    a_again = await api.post(key, command(amount=100), token="token-a")
    b_again = await api.post(key, command(amount=200), token="token-b")
    assert a_again.content == a.content and b_again.content == b.content  # each replays its own
    assert await effects(api) == [("client-a", key, 100), ("client-b", key, 200)]
    tenants = await api.rows("SELECT headers->>'tenant-id', headers->>'operation-id' FROM outbox ORDER BY id")
    assert tenants == [("client-a", key), ("client-b", key)]


async def test_an_unauthenticated_request_is_refused_and_not_stored(api: Api) -> None:
    key = new_key()
    refused = await api.post(key, token="stolen")
    assert refused.status_code == 401
    assert await api.rows("SELECT 1 FROM operations") == []
    accepted = await api.post(key)
    assert accepted.status_code == 202 and not replayed(accepted)


# -- what is stored: success and reported failures; never a rejection ------------------------------


async def test_a_validation_error_is_not_stored_and_the_fixed_request_runs(api: Api) -> None:
    key = new_key()
    invalid = await api.post(key, {k: v for k, v in command().items() if k != "currency"})
    assert invalid.status_code == 422 and invalid.headers["content-type"] == "application/json"  # FastAPI's own
    assert await api.rows("SELECT 1 FROM operations") == []
    fixed = await api.post(key)
    assert fixed.status_code == 202 and not replayed(fixed)
    assert len(await effects(api)) == 1


async def test_a_business_failure_is_stored_and_replayed(api: Api) -> None:
    key = new_key()
    failed = await api.post(key, command(amount=-5))
    again = await api.post(key, command(amount=-5))
    problem = assert_problem(failed, 422, "operation-failed")
    assert problem["code"] == "negative_amount"
    assert again.status_code == 422 and again.content == failed.content and replayed(again)
    assert await api.rows("SELECT state, result_status FROM operations") == [("failed", "negative_amount")]
    assert await effects(api) == [] and await api.rows("SELECT 1 FROM outbox") == []


async def test_a_replay_after_the_response_expired_is_410_and_never_runs_again(api: Api) -> None:
    key = new_key()
    assert (await api.post(key)).status_code == 202
    await api.rows("UPDATE operations SET result_body = NULL RETURNING 1")  # what consumer-kit prune does
    expired = await api.post(key)
    assert_problem(expired, 410, "response-expired")
    assert replayed(expired)
    assert len(await effects(api)) == 1


async def test_contention_in_the_endpoint_is_503_with_retry_after_and_nothing_stored(
    api: Api, database_url: str
) -> None:
    key = new_key()
    async with serving(database_url, api.schema, lock_timeout=0.2) as impatient:
        async with table_locked(database_url, api.schema):
            busy = await impatient.post(key)  # its INSERT gives up after lock_timeout: contention
    problem = assert_problem(busy, 503, "try-again")
    assert busy.headers["retry-after"] == "1" and "same Idempotency-Key" in problem["detail"]
    assert await api.rows("SELECT 1 FROM operations") == [] and await effects(api) == []
    retry = await api.post(key)
    assert retry.status_code == 202 and not replayed(retry)
    assert len(await effects(api)) == 1


# -- crash between COMMIT and the response (crash-point kit) ---------------------------------------


async def test_a_crash_after_commit_before_the_response_is_answered_on_retry(api: Api) -> None:
    key = new_key()
    crashpoints.arm(CrashPoint.AFTER_COMMIT_BEFORE_RESPONSE, action="raise")
    try:
        with pytest.raises(SimulatedCrash):
            await api.post(key)  # the process "died": no response went out
    finally:
        crashpoints.disarm_all()
    ((request_id, *_),) = await api.rows("SELECT request_id, operation_key FROM invoice_requests")
    retry = await api.post(key)
    assert retry.status_code == 202 and replayed(retry)
    assert retry.json() == {
        "request_id": request_id, "order_id": 418, "revision": 2, "operation_key": key, "status": "accepted",
    }
    assert len(await effects(api)) == 1
    assert len(await api.rows("SELECT 1 FROM outbox")) == 1


async def test_the_published_rules_are_served_at_the_linked_docs(api: Api) -> None:
    rules = (await api.client.get("/docs/idempotency")).json()
    assert rules["header"] == "Idempotency-Key"
    assert "16 to 255 characters" in rules["key_format"]
    assert rules["stored_response_max_bytes"] == 65536
    assert json.loads(json.dumps(rules)) == rules


async def _equals(count: Awaitable[int], expected: int) -> bool:
    return await count == expected
