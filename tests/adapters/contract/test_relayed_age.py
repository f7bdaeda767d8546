"""A relay publish carries the operation's age: the event's outbox row was committed at
``created_at``, and the operations it starts are that old on arrival, whenever the relay publishes
it. The relay's publisher writes ``created_at`` as the signed first-enqueued mark, on every broker:
an event whose row is older than the consuming handler's key retention is refused ``key_expired``."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from consumer_kit import Outcome
from consumer_kit.adapters.memory import MemoryPublisher
from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.codec import headers as own
from consumer_kit.demo.app import CreateInvoiceHandler
from consumer_kit.outbox_relay.counters import RelayCounters
from consumer_kit.outbox_relay.publishing import RowPublisher
from consumer_kit.outbox_relay.routing import Routing
from consumer_kit.outbox_relay.store import ClaimedRow
from tests.adapters.contract.conftest import Contract
from tests.adapters.contract.memory_driver import MemoryDriver
from tests.fixtures.broker_env import command


class ShortLived(CreateInvoiceHandler):
    key_retention = dt.timedelta(minutes=10)


def relayed(
    queue: str, body: bytes, headers: dict[str, str], *, created_at: dt.datetime, message_type: str = "CreateInvoice",
) -> OutgoingMessage:
    """The message the relay publishes for an outbox row committed at ``created_at`` (to ``queue``
    on the default destination), built by the relay's own code."""
    row = ClaimedRow(
        id=1, event_id=uuid.uuid4(), destination="commands", routing_key=queue, message_type=message_type,
        partition_key=None, payload=body.decode(), headers=headers, attempts=0, operation_scope=None,
        operation_key=None, correlation_id=None, created_at=created_at, previous_owner=None,
    )
    rows = RowPublisher(MemoryPublisher(None), Routing(), RelayCounters(),  # type: ignore[arg-type]
                        relay_id="relay-test", messaging_system="test", max_in_flight=1)
    return rows.outgoing(row, "", queue, {str(k): str(v) for k, v in headers.items()})


def publisher_of(contract: Contract) -> Publisher:
    """The driver's own consumer-kit publisher (the one the relay would use)."""
    driver: Any = contract.driver
    if isinstance(driver, MemoryDriver):
        return MemoryPublisher(driver.broker)
    return driver._publisher if hasattr(driver, "_publisher") else driver.publisher  # type: ignore[no-any-return]


async def test_a_relay_publish_of_an_outbox_row_older_than_the_key_retention_is_key_expired(
    contract: Contract,
) -> None:
    """Published now, committed an hour ago: refused; the same event committed now executes."""
    old = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    async with contract.worker(ShortLived()):
        late = relayed(contract.driver.queue, command(order_id=7), {"operation-id": f"op-{uuid.uuid4()}"},
                       created_at=old)
        assert own.FIRST_ENQUEUED not in late.headers  # the publisher writes and signs the mark
        await publisher_of(contract).publish(late)
        expired = await contract.next_report()
        fresh = relayed(contract.driver.queue, command(order_id=8), {"operation-id": f"op-{uuid.uuid4()}"},
                        created_at=dt.datetime.now(dt.UTC))
        await publisher_of(contract).publish(fresh)
        executed = await contract.next_report()
    assert (expired.outcome, expired.reason) == (Outcome.KEY_EXPIRED, "key_expired")
    assert executed.outcome is Outcome.EXECUTED
    assert await contract.rows("SELECT count(*) FROM invoices") == [(1,)]


async def test_a_first_enqueued_mark_in_an_outbox_rows_headers_is_never_signed_by_the_relay(
    contract: Contract,
) -> None:
    """A handler that stored a forged first-enqueued time (a day ago) in its event's headers does
    not make the event old: the publisher drops marks it did not write."""
    forged = {"operation-id": f"op-{uuid.uuid4()}", own.FIRST_ENQUEUED: "2000-01-01T00:00:00+00:00"}
    async with contract.worker(ShortLived()):
        await publisher_of(contract).publish(
            relayed(contract.driver.queue, command(order_id=9), forged, created_at=dt.datetime.now(dt.UTC)))
        report = await contract.next_report()
    assert report.outcome is Outcome.EXECUTED
