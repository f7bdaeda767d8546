"""First and last failure of a dead letter, as ``dlq list``, its ``--json`` and the console show
them, for the times each broker reports (RabbitMQ: the first retry's expiry; SQS and NATS: the
dead-lettering; Service Bus: none): the ledger's attempt history decides where it recorded a fault,
the broker's time only stands in where it did not, and a time nobody knows stays unknown."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator

import psycopg
import pytest

from consumer_kit.broker import DeadLetter
from consumer_kit.ledger import AttemptBook
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.ops.operator_actions import dead_letter_rows
from consumer_kit.ops.stats import UNKNOWN_TIME, ago_text
from consumer_kit.settings import BrokerSettings
from tests.fixtures.harness import throwaway_schema

pytestmark = pytest.mark.postgres

FAILED = OperationIdentity("default", "invoice.create", 1, "order-1", "f" * 64, 1)
LONG_AGO = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
SOON = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)


def letter(key: str, dead_lettered_at: dt.datetime | None, enqueued_at: dt.datetime | None = None) -> DeadLetter:
    return DeadLetter(queue="q", message_id=f"m-{key}", reason="max_deliveries_exceeded:RetryableError",
                      detail="", delivery_count=3, dead_lettered_at=dead_lettered_at, enqueued_at=enqueued_at,
                      operation_key=key, headers={}, body=b"{}")


@pytest.fixture
async def schema(database_url: str) -> AsyncIterator[str]:
    async with throwaway_schema(database_url, example_tables=False) as name:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            book = AttemptBook(name, "host:1")
            for attempt in (1, 2, 3):
                await book.count_failure(conn, FAILED, message_id="m-order-1", delivery_count=attempt, detail="x")
        yield name


async def ledger_times(database_url: str, schema: str) -> tuple[dt.datetime, dt.datetime]:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        record = await AttemptBook(schema, "host:1").fetch(conn, FAILED.scope, FAILED.key)
    assert record is not None
    times = [dt.datetime.fromisoformat(entry["at"]) for entry in record.history]
    return min(times), max(times)


@pytest.mark.parametrize("broker_time", [None, LONG_AGO, SOON], ids=["service bus", "rabbitmq", "sqs, nats"])
async def test_the_ledger_decides_first_and_last_failure_whatever_the_broker_says(
    database_url: str, schema: str, broker_time: dt.datetime | None,
) -> None:
    first, last = await ledger_times(database_url, schema)
    settings = BrokerSettings(database_url=database_url, db_schema=schema)
    [row] = await dead_letter_rows(settings, None, [letter("order-1", broker_time)])
    assert (row.first_failure, row.last_failure) == (first, last)


async def test_without_a_ledger_record_the_broker_time_stands_in_and_none_is_unknown(
    database_url: str, schema: str,
) -> None:
    settings = BrokerSettings(database_url=database_url, db_schema=schema)
    conflict, silent = await dead_letter_rows(settings, None, [
        letter("never-failed", LONG_AGO),  # a payload conflict: the ledger has no fault of it
        letter("never-failed-2", None),  # and a broker that keeps no time
    ])
    assert (conflict.first_failure, conflict.last_failure) == (LONG_AGO, LONG_AGO)
    assert (silent.first_failure, silent.last_failure) == (None, None)
    assert ago_text(silent.last_failure) == UNKNOWN_TIME == "unknown"
    assert ago_text(LONG_AGO, LONG_AGO + dt.timedelta(seconds=185)) == "3m05s ago"
