"""End to end: the invoices example's handler on NATS JetStream (the local nats-server)
with ``consumer_kit.worker.process.Worker``, ``consumer-kit declare``, the outbox relay and the real
PostgreSQL, configured by environment alone (only the broker URL differs from RabbitMQ).

The contract suite runs the broker cases on NATS (``tests/adapters/contract``, driver ``nats``). This module
adds what is NATS's own: the streams and durable consumer ``consumer-kit declare`` creates, the
relay's publish with ``Nats-Msg-Id`` = event ID on a subject per partition key, and JetStream's
duplicate window dropping a relay's repeat of the same event.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from consumer_kit import App, DeliveryReport, Outcome
from consumer_kit.adapters.nats import NATSConfig, NATSConnection, NATSConsumer, NATSPublisher, stream_name
from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.outbox_relay import Relay
from consumer_kit.outbox_relay.settings import RelaySettings
from consumer_kit.worker.process import Worker
from tests.adapters.contract.nats_driver import nats_url  # noqa: F401 - fixture
from tests.fixtures.broker_env import command
from tests.fixtures.harness import fetch_all, throwaway_schema

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[3]
RUN = os.environ.get("CK_TEST_NATS_RUN") or uuid.uuid4().hex[:10]  # the declare subprocess gets the same
QUEUE = f"ck-e2e-{RUN}.commands"
EVENTS = f"ck-e2e-{RUN}.billing"

app = App("invoices-on-nats", events=[EVENTS])
app.subscribe(QUEUE, CreateInvoiceHandler())
"""The invoices example's handler on this run's own queue (``consumer-kit declare`` loads it)."""


async def _delete_streams(connection: NATSConnection, *names: str) -> None:
    js = await connection.jetstream()
    for name in names:
        try:
            await js.delete_stream(name)
        except NotFoundError:
            pass


async def test_the_invoices_example_runs_on_nats_by_changing_the_broker_url(
    database_url: str, nats_url: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811 - fixture
) -> None:
    connection = NATSConnection(NATSConfig.from_url(nats_url))
    streams = (stream_name(QUEUE), f"{stream_name(QUEUE)}_dlq", stream_name(EVENTS))
    try:
        async with throwaway_schema(database_url) as schema:
            env = {
                "CONSUMER_KIT_DATABASE_URL": database_url, "CONSUMER_KIT_DB_SCHEMA": schema,
                "CONSUMER_KIT_SEARCH_PATH": schema, "CONSUMER_KIT_BROKER_URL": nats_url,
                # the example's billing.events, renamed for this run (the server is shared)
                "CONSUMER_KIT_RELAY_DESTINATIONS": json.dumps({"billing.events": {"exchange": EVENTS}}),
            }
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            declared = subprocess.run(
                [str(Path(sys.executable).with_name("consumer-kit")), "declare", "tests.adapters.nats.test_end_to_end:app"],
                cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, **env, "CK_TEST_NATS_RUN": RUN},
            )
            assert declared.returncode == 0, declared.stdout + declared.stderr
            js = await connection.jetstream()
            consumer_info = await js.consumer_info(stream_name(QUEUE), stream_name(QUEUE))
            assert consumer_info.config.max_deliver == 50  # the loop guard above 3 + 3
            await js.stream_info(stream_name(EVENTS))

            reports: asyncio.Queue[DeliveryReport] = asyncio.Queue()
            worker = Worker(app, on_report=reports.put_nowait)  # Settings() from the environment
            task = asyncio.create_task(worker.run())
            try:
                await asyncio.wait_for(worker.started.wait(), 30)
                assert isinstance(worker._consumer, NATSConsumer)
                sender = NATSPublisher(NATSConfig.from_url(nats_url), connection=connection)
                for _ in range(3):  # three messages, one operation
                    await sender.publish(OutgoingMessage("", QUEUE, str(uuid.uuid4()), command(), "CreateInvoice"))
                outcomes = sorted([(await asyncio.wait_for(reports.get(), 20)).outcome for _ in range(3)])
            finally:
                worker.stop()
                await asyncio.wait_for(task, 30)
            assert outcomes == sorted([Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.DUPLICATE])
            assert (await js.stream_info(stream_name(QUEUE))).state.messages == 0  # acked: gone

            relay = Relay(RelaySettings())
            await relay.run(once=True)
            assert relay.counters["published"] == 1
            [(event_id, customer)] = await fetch_all(database_url, schema, "SELECT event_id, partition_key FROM outbox")
            event = await js.get_msg(stream_name(EVENTS), seq=1)
            assert event.subject == f"{EVENTS}.invoice.created.k.{customer}" and customer == "c-1"
            assert event.headers is not None and event.headers["Nats-Msg-Id"] == str(event_id)
            assert event.headers["message-type"] == "InvoiceCreated" and event.headers["partition-key"] == "c-1"
            assert json.loads(event.data or b"{}")["customer_id"] == "c-1"

            # a relay that crashed after the publish and before marking the row publishes it again:
            # the duplicate window stores it once
            again = NATSPublisher(NATSConfig.from_url(nats_url), connection=connection)
            await again.publish(OutgoingMessage(EVENTS, "invoice.created", str(event_id), event.data or b"",
                                                "InvoiceCreated", partition_key=customer))
            assert again.duplicates == 1
            assert (await js.stream_info(stream_name(EVENTS))).state.messages == 1
    finally:
        await _delete_streams(connection, *streams)
        await connection.close()


async def test_a_message_no_delivery_can_be_made_of_is_dead_lettered_with_a_signed_reason(
    nats_url: str,  # noqa: F811 - fixture
) -> None:
    """A pulled message whose JetStream metadata cannot be read (here: a reply subject that is no
    ack subject) is copied to the dead-letter stream as ``invalid_header`` and never handed out;
    ``consumer-kit dlq list`` believes its reason (the copy is signed)."""
    from nats.aio.msg import Msg

    from consumer_kit.adapters.nats import NATSDeadLetters

    queue = f"ck-raw-{uuid.uuid4().hex[:10]}.commands"
    config = NATSConfig.from_url(nats_url)
    consumer = NATSConsumer(config)
    handed: list[object] = []

    async def callback(delivery: object) -> None:
        handed.append(delivery)

    dead = NATSDeadLetters(config)
    try:
        await consumer.subscribe(queue, callback, prefetch=1)  # type: ignore[arg-type]
        client = await consumer.connection.client()
        raw = Msg(_client=client, subject=queue, reply="not.an.ack.subject", data=b"{}", headers={"tenant-id": "t"})
        assert await consumer.subscription(queue).accept(raw, 0.0) is None
        [letter] = await dead.peek(queue)
        assert (letter.reason, letter.queue, letter.body) == ("invalid_header", queue, b"{}")
        assert handed == []
    finally:
        await consumer.close()
        await _delete_streams(dead.connection, stream_name(queue), f"{stream_name(queue)}_dlq")
        await dead.close()


async def test_an_idle_queue_keeps_the_consumer_ready(nats_url: str) -> None:  # noqa: F811 - fixture
    """Empty pulls (nothing arrived in ``fetch_wait``) are no outage: the consumer stays ready."""
    queue = f"ck-idle-{uuid.uuid4().hex[:10]}.commands"
    consumer = NATSConsumer(NATSConfig.from_url(f"{nats_url}?fetch_wait=0.2"))

    async def callback(delivery: object) -> None:
        raise AssertionError("nothing was sent")

    try:
        await consumer.subscribe(queue, callback, prefetch=8)  # type: ignore[arg-type]
        async with asyncio.timeout(15):
            while consumer.subscription(queue).pulls < 3:
                await asyncio.sleep(0.05)  # waiting for three empty pulls (a condition)
        assert consumer.ready and not consumer.subscription(queue).failing
    finally:
        await consumer.close()
        cleanup = NATSConnection(NATSConfig.from_url(nats_url))
        await _delete_streams(cleanup, stream_name(queue), f"{stream_name(queue)}_dlq")
        await cleanup.close()
