"""``POST /invoices``: the HTTP front door of the invoices example (FastAPI).

A client sends ``CreateInvoice`` with an ``Idempotency-Key``. In **one transaction** the endpoint
records the request in ``invoice_requests``, the ledger completes with the ``202`` response, and
the command goes into the outbox for the queue the worker consumes (``invoices.commands``),
carrying the key as header ``operation-id`` and the client as ``tenant-id``. The relay publishes
it; the worker's ``CreateInvoiceHandler`` runs it with that key as its operation key. A retry with
the key gets the same ``202`` back (``Idempotent-Replayed: true``) and writes nothing.

    uvicorn consumer_kit.demo.api:create_app --factory --port 8000

Clients authenticate with ``Authorization: Bearer <token>``; ``INVOICES_API_TOKENS`` maps tokens to
client ids (JSON, default ``{"demo-token": "demo-client"}``).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, HTTPException, Request, Response
from pydantic import BaseModel

from consumer_kit import Settings
from consumer_kit.http import (
    CurrentOperation,
    Idempotency,
    IdempotencyPolicy,
    IdempotentRoute,
    OperationFailed,
)

from .app import CreateInvoice

QUEUE = "invoices.commands"
DOCS_PATH = "/docs/idempotency"
DEFAULT_TOKENS = {"demo-token": "demo-client"}

REQUESTS_SQL = """
CREATE TABLE IF NOT EXISTS invoice_requests (
    request_id    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    client_id     text NOT NULL,
    operation_key text NOT NULL,
    order_id      bigint NOT NULL,
    revision      integer NOT NULL,
    amount_cents  bigint NOT NULL,
    accepted_at   timestamptz NOT NULL DEFAULT now()
)
"""


class InvoiceAccepted(BaseModel):
    """The ``202`` body: the request was recorded and the command queued."""

    request_id: int
    order_id: int
    revision: int
    operation_key: str
    status: str = "accepted"


def tokens_from_environment() -> dict[str, str]:
    """``INVOICES_API_TOKENS`` (JSON object: token -> client id), else the demo token."""
    raw = os.environ.get("INVOICES_API_TOKENS")
    return dict(json.loads(raw)) if raw else dict(DEFAULT_TOKENS)


def create_app(
    settings: Settings | None = None,
    *,
    queue: str = QUEUE,
    tokens: Mapping[str, str] | None = None,
    docs_url: str = DOCS_PATH,
) -> FastAPI:
    """The API. ``settings`` default to the environment (``CONSUMER_KIT_DATABASE_URL``,
    ``CONSUMER_KIT_DB_SCHEMA``, ...); ``queue`` is where ``CreateInvoice`` goes."""
    settings = settings or Settings.from_environment()
    known = dict(tokens or tokens_from_environment())

    def client_of(request: Request) -> str:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        client = known.get(token.strip()) if scheme.lower() == "bearer" else None
        if client is None:
            raise HTTPException(401, "unknown or missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        return client

    idempotency = Idempotency(settings, client=client_of, policy=IdempotencyPolicy(docs_url=docs_url))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with idempotency.lifespan(app):
            async with idempotency.pool.connection() as conn:
                await conn.execute(REQUESTS_SQL)
            yield

    app = FastAPI(title="invoices", lifespan=lifespan)
    router = APIRouter(route_class=IdempotentRoute)

    @router.post("/invoices", status_code=202, response_model=InvoiceAccepted)
    @idempotency.endpoint(exclude={"requested_at"})  # a resend's new timestamp is not a new intent
    async def create_invoice(command: CreateInvoice, response: Response, op: CurrentOperation) -> InvoiceAccepted:
        if command.amount_cents < 0:  # recorded: every retry with this key gets this 422 again
            raise OperationFailed("negative_amount", "an invoice amount cannot be negative")
        cur = await op.connection.execute(
            "INSERT INTO invoice_requests (client_id, operation_key, order_id, revision, amount_cents) "
            "VALUES (%s, %s, %s, %s, %s) RETURNING request_id",
            (op.client, op.key, command.order_id, command.revision, command.amount_cents),
        )
        row = await cur.fetchone()
        assert row is not None
        await op.publish(  # headers operation-id = the key, tenant-id = the client
            command, destination=queue, routing_key=queue, partition_key=command.customer_id,
        )
        response.headers["Location"] = f"/invoice-requests/{row[0]}"
        return InvoiceAccepted(
            request_id=int(row[0]), order_id=command.order_id, revision=command.revision, operation_key=op.key
        )

    @app.get(DOCS_PATH)
    async def idempotency_rules() -> dict[str, object]:
        """The published idempotency specification (the draft's section 2.5)."""
        return idempotency.policy.describe()

    app.include_router(router)
    return app
