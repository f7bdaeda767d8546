"""End to end: one operation key from the HTTP request to the worker.

A real uvicorn server on a free port serves examples/invoices/api.py; three retries of one
``POST /invoices`` (one Idempotency-Key) write one outbox row; the relay (in process) publishes it
to the test's command queue on RabbitMQ; the worker (in process) runs ``CreateInvoiceHandler``
under the same key: one invoice.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
import uvicorn

from consumer_kit import Outcome, Settings
from consumer_kit.demo.api import create_app
from consumer_kit.outbox_relay import Relay
from consumer_kit.outbox_relay.routing import Routing
from consumer_kit.outbox_relay.settings import RouteTarget
from tests.fixtures.broker_env import Env
from tests.fixtures.relay_support import relay_settings

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]


async def test_three_retried_requests_are_one_invoice_through_uvicorn_the_relay_and_rabbitmq(env: Env) -> None:
    api = create_app(
        Settings(database_url=env.database_url, db_schema=env.schema, search_path=env.schema),
        queue=env.queue, tokens={"token-a": "client-a"},
    )
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve())
    # the command queue is the default exchange's: the relay's destination map says so
    relay = Relay(
        relay_settings(env.database_url, env.schema, env.rabbitmq_url),
        routing=Routing({env.queue: RouteTarget(exchange="")}),
    )
    relaying: asyncio.Task[None] | None = None
    key = str(uuid.uuid4())
    body = {
        "order_id": 418, "revision": 2, "customer_id": "c-1", "amount_cents": 1250, "currency": "EUR",
        "requested_at": "2026-03-01T10:00:00+00:00",
    }
    try:
        async with asyncio.timeout(30):
            while not server.started:  # uvicorn's own flag: bound, lifespan done
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with env.worker():  # declares the queue, then consumes it
            relaying = asyncio.create_task(relay.run())
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                responses = [
                    await client.post(
                        "/invoices", json=body,
                        headers={"Authorization": "Bearer token-a", "Idempotency-Key": f'"{key}"'},
                    )
                    for _ in range(3)
                ]
            (report,) = await env.next_reports(1)
            relay.request_stop()
            await asyncio.wait_for(relaying, 15)
    finally:
        if relaying is not None and not relaying.done():
            relay.request_stop()
            await asyncio.wait_for(relaying, 15)
        server.should_exit = True
        await asyncio.wait_for(serving, 15)

    assert [r.status_code for r in responses] == [202, 202, 202]
    assert [r.headers.get("idempotent-replayed") for r in responses] == [None, "true", "true"]
    assert responses[0].content == responses[1].content == responses[2].content
    # HTTP key -> ledger -> outbox -> broker header -> the worker's operation key
    assert report.outcome is Outcome.EXECUTED
    assert (report.scope, report.operation_key) == ("client-a/invoice.create/v1", key)
    assert await env.rows("SELECT scope, key, state FROM operations ORDER BY scope") == [
        ("client-a/POST /invoices/v1", key, "completed"),
        ("client-a/invoice.create/v1", key, "completed"),
    ]
    assert len(await env.rows("SELECT invoice_id FROM invoices")) == 1
    assert await env.rows("SELECT invoiced_cents FROM customers") == [(1250,)]
    assert await env.rows("SELECT count(*) FROM invoice_requests") == [(1,)]
    commands = await env.rows("SELECT operation_key FROM outbox WHERE destination = %s AND published_at IS NOT NULL", env.queue)
    assert commands == [(key,)]
    assert relay.counters["published"] == 1
    assert await env.queue_depth() == 0
