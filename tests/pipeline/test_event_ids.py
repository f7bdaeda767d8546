"""Event ids derived from the operation and the event's place in it (consumer_kit.outbox.event_id_for):
an execution re-run after its commit was lost (a failed-over primary with asynchronous replication)
publishes the same ids, so deduplication by event id downstream holds."""

from __future__ import annotations

import uuid

from consumer_kit import App, Outcome
from consumer_kit.adapters.memory import MemoryBroker
from consumer_kit.codec import marks
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.outbox import event_id_for
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema
from tests.pipeline.test_runtime import QUEUE, command, run_all


async def test_a_re_execution_after_a_lost_commit_publishes_the_same_event_ids(database_url: str) -> None:
    app = App("test")
    app.subscribe(QUEUE, CreateInvoiceHandler())
    body = command(order_id=7)
    async with throwaway_schema(database_url) as schema, runtime_for(app, database_url, schema) as rt:
        broker = MemoryBroker()
        broker.send(QUEUE, body)
        broker.send(QUEUE, command(order_id=8))
        assert {r.outcome for r in await run_all(broker, rt)} == {Outcome.EXECUTED}
        first = await fetch_all(database_url, schema, "SELECT event_id FROM outbox ORDER BY id")
        # the commit of both is lost: the new primary has none of their rows
        await fetch_all(database_url, schema, "WITH a AS (DELETE FROM outbox), b AS (DELETE FROM invoices),"
                        " c AS (UPDATE customers SET invoiced_cents = 0) DELETE FROM operations RETURNING 1")
        broker.send(QUEUE, body)
        broker.send(QUEUE, command(order_id=8))
        assert {r.outcome for r in await run_all(broker, rt)} == {Outcome.EXECUTED}
        again = await fetch_all(database_url, schema, "SELECT event_id FROM outbox ORDER BY id")
    assert len(first) == 2 and sorted(again) == sorted(first)
    assert len(set(first)) == 2  # two operations, two ids


def test_an_event_id_is_keyed_so_no_producer_can_compute_it_in_advance() -> None:
    parts = ("tenant-a/invoice.create/v1", "order-7-rev-1", "f" * 64, 0)
    first = event_id_for(*parts)
    assert first == event_id_for(*parts) and first != event_id_for(*parts[:3], 1)
    public = {uuid.uuid5(namespace, "\n".join(map(str, parts)))
              for namespace in (uuid.NAMESPACE_OID, uuid.NAMESPACE_URL, uuid.UUID("6f0e4a52-2a3b-5c1d-9e57-3c6b1d0a8f21"))}
    assert first not in public  # not a hash of parts a producer knows
    previous = marks.installed()
    marks.install(b"another deployment's key, 32 bytes+")
    try:
        assert event_id_for(*parts) != first
    finally:
        marks.install(previous.current, previous.previous, source=previous.source)
