"""spans, metrics and logs of real deliveries on RabbitMQ and PostgreSQL, read through the
OpenTelemetry SDK's in-memory exporters (``tests/fixtures/telemetry_kit.py``)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import aio_pika
import psycopg
import pytest
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from consumer_kit import App, Context, Handler, Outcome, Result
from consumer_kit.cli.console import OWN_LOGGERS
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler, InvoiceCreated
from consumer_kit.outbox_relay import Relay, RelaySettings
from consumer_kit.telemetry.describe import describe_error, describe_traceback
from consumer_kit.telemetry.logs import JsonFormatter, SafeTextFormatter
from consumer_kit.telemetry.metrics import CATALOGUE, OUTCOME_COUNTERS, QUEUE
from tests.fixtures.broker_env import Env, command
from tests.fixtures.telemetry_kit import Telemetry

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

OUTCOME_COUNTER_NAMES = sorted(set(OUTCOME_COUNTERS.values()) | {"consumer_kit.dead_letters"})


def counters_of(otel: Telemetry, queue: str) -> dict[str, float]:
    return {name: otel.value(name, attrs={QUEUE: queue}) for name in OUTCOME_COUNTER_NAMES}


async def test_a_duplicate_is_a_duplicate_span_and_counts_only_as_a_duplicate(env: Env, otel: Telemetry) -> None:
    async with env.worker():
        await env.send(command())
        (first,) = await env.next_reports(1)
        before = counters_of(otel, env.queue)
        deliveries_before = otel.value("consumer_kit.deliveries", attrs={QUEUE: env.queue})
        duplicate_id = await env.send(command())
        (second,) = await env.next_reports(1)
    assert (first.outcome, second.outcome) == (Outcome.EXECUTED, Outcome.DUPLICATE)

    after = counters_of(otel, env.queue)
    changed = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    assert changed == {"consumer_kit.duplicates": 1}
    assert otel.value("consumer_kit.deliveries", attrs={QUEUE: env.queue}) == deliveries_before + 1
    assert otel.value("consumer_kit.duplicates", attrs={
        QUEUE: env.queue, "consumer_kit.operation.type": "invoice.create", "consumer_kit.outcome": "duplicate",
    }) == 1

    [span] = [s for s in otel.spans() if s.attributes and s.attributes.get("messaging.message.id") == duplicate_id]
    assert span.name == f"process {env.queue}" and span.kind is SpanKind.CONSUMER
    attributes = dict(span.attributes or {})
    assert attributes["consumer_kit.outcome"] == "duplicate"
    assert attributes["messaging.system"] == "rabbitmq"
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["consumer_kit.operation.key"] == "order-418-rev-2"
    assert attributes["consumer_kit.scope"] == "default/invoice.create/v1"
    assert attributes["consumer_kit.delivery_count"] == 1
    children = [s.name for s in otel.spans() if s.parent and s.parent.span_id == span.context.span_id]
    # a duplicate runs no handler, and its answer does not wait for its transaction's end
    assert children == ["consumer_kit.claim"]


class NoteInvoice(Handler[InvoiceCreated]):
    """Consumes the invoices example's event; its key is the event id (the message id)."""

    operation_type = "invoice.note"
    key_from_message_id = True

    async def handle(self, message: InvoiceCreated, ctx: Context) -> Result:
        return Result("noted")


async def bind_events_queue(env: Env, queue: str) -> None:
    connection = await aio_pika.connect(env.rabbitmq_url)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange("billing.events", aio_pika.ExchangeType.TOPIC, durable=True)
        declared = await channel.declare_queue(queue, passive=True)
        await declared.bind(exchange, "invoice.created")
    finally:
        await connection.close()


async def test_one_trace_runs_from_the_command_through_the_outbox_to_the_event(
    env: Env, otel: Telemetry
) -> None:
    producer = trace.get_tracer("tests.producer")
    headers: dict[str, str] = {"correlation-id": "corr-418"}
    with producer.start_as_current_span("send CreateInvoice", kind=SpanKind.PRODUCER) as root:
        propagate.inject(headers)
    trace_id = root.get_span_context().trace_id
    events_queue = env.queue.replace(".commands", ".events")
    events = App("events")
    events.subscribe(events_queue, NoteInvoice())

    async with env.worker(), env.worker(events):
        await bind_events_queue(env, events_queue)
        await env.send(command(), headers)
        (executed,) = await env.next_reports(1)
        assert executed.outcome is Outcome.EXECUTED
        # The context travels in the outbox row's stored headers, not in this process's memory.
        [(stored,)] = await env.rows("SELECT headers FROM outbox")
        assert stored["traceparent"].split("-")[1] == f"{trace_id:032x}"
        relay = Relay(RelaySettings(
            database_url=env.database_url, broker_url=env.rabbitmq_url, db_schema=env.schema,
        ))
        await relay.run(once=True)
        assert relay.counters["published"] == 1
        (noted,) = await env.next_reports(1)
        assert noted.outcome is Outcome.EXECUTED and noted.queue == events_queue

    spans = [s for s in otel.spans() if s.context.trace_id == trace_id]
    by_name = {s.name: s for s in spans}
    command_span = by_name[f"process {env.queue}"]
    publish_span = by_name["publish billing.events"]
    event_span = by_name[f"process {events_queue}"]
    assert command_span.parent is not None and command_span.parent.span_id == root.get_span_context().span_id
    assert publish_span.kind is SpanKind.PRODUCER
    [handle_span] = [s for s in spans if s.name == "consumer_kit.handle" and s.parent is not None
                     and s.parent.span_id == command_span.context.span_id]
    assert publish_span.parent is not None and publish_span.parent.span_id == handle_span.context.span_id
    assert event_span.parent is not None and event_span.parent.span_id == publish_span.context.span_id
    assert dict(publish_span.attributes or {})["messaging.operation.type"] == "send"
    assert dict(command_span.attributes or {})["messaging.message.conversation_id"] == "corr-418"
    assert dict(command_span.attributes or {})["consumer_kit.event_count"] == 1
    assert {"consumer_kit.claim", "consumer_kit.handle", "consumer_kit.commit"} <= set(by_name)
    assert otel.value("consumer_kit.outbox.commit_to_publish", attrs={QUEUE: "billing.events"}) >= 1


class FailingOnMarker(CreateInvoiceHandler):
    """Fails the way real code does with a bad value: odd orders in Python (the exception's text
    quotes the value), even orders in PostgreSQL (class 22: its message quotes the value)."""

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        if message.order_id % 2:
            return int(message.customer_id)
        await ctx.connection.execute("SELECT %s::integer", (message.customer_id,))
        return None


class Everything(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def every_log_record() -> Iterator[Everything]:
    """Every record of every logger at DEBUG (libraries included) while the test runs."""
    root = logging.getLogger()
    saved = {name: logging.getLogger(name).level for name in ("", *logging.root.manager.loggerDict)}
    capture = Everything()
    root.addHandler(capture)
    for name in saved:
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        yield capture
    finally:
        root.removeHandler(capture)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def renderings(record: logging.LogRecord) -> list[str]:
    """Everything a log record can turn into: its message, its raw fields (arguments, extras,
    exception and all), the default text formatter (what an application's own handler prints)
    and consumer-kit's text and JSON formatters."""
    return [
        record.getMessage(), repr(record.__dict__), logging.Formatter().format(record),
        SafeTextFormatter().format(record), JsonFormatter().format(record),
    ]


async def test_a_marker_in_the_payload_and_headers_reaches_no_log_record(
    env: Env, every_log_record: Everything
) -> None:
    marker = "MARKER-" + uuid.uuid4().hex
    failing_queue = env.queue.replace(".commands", ".failing")
    app = App("marked")
    app.subscribe(env.queue, CreateInvoiceHandler())
    app.subscribe(failing_queue, FailingOnMarker())
    headers = {"x-secret": marker, "correlation-id": "corr-marker"}
    async with env.worker(app):
        await env.send(command(customer_id=marker), headers)
        await env.send(command(customer_id=marker), headers)  # a duplicate
        await env.send(command(amount=1, customer_id=marker), headers)  # a payload conflict
        await env.send(b'{"order_id": "' + marker.encode() + b'"}', headers)  # schema mismatch
        await env.send(b'{"' + marker.encode() + b'": 1, ', headers)  # invalid JSON
        await env.send_to(failing_queue, command(order_id=7, customer_id=marker), headers)
        await env.send_to(failing_queue, command(order_id=8, customer_id=marker), headers)
        reports = await env.reports_until(
            lambda seen: sum(r.settlement is not None and r.settlement.value in ("ack", "dead_letter")
                             for r in seen) == 7
        )
        relay = Relay(RelaySettings(database_url=env.database_url, broker_url=env.rabbitmq_url, db_schema=env.schema))
        await relay.run(once=True)
    outcomes = sorted(r.outcome.value for r in reports if r.outcome is not Outcome.RETRIED)
    assert outcomes == sorted(["executed", "duplicate", "payload_conflict", "invalid", "invalid", "invalid",
                               "dead_lettered"])
    assert relay.counters["published"] == 1
    [(payload,)] = await env.rows("SELECT payload FROM outbox")
    assert payload["customer_id"] == marker  # the marker really went through the outbox

    # consumer-kit's own loggers at DEBUG; other libraries at --library-log-level's default
    # (WARNING): aiormq's DEBUG frame dumps hold whole messages, bodies included.
    checked = [r for r in every_log_record.records
               if r.name.split(".")[0] in OWN_LOGGERS or r.levelno >= logging.WARNING]
    leaks = [f"{record.name}: {record.getMessage()[:200]}"
             for record in checked for text in renderings(record) if marker in text]
    assert leaks == []
    assert sum(r.levelno == logging.DEBUG for r in checked) > 20  # DEBUG really was on
    lines = [json.loads(JsonFormatter().format(r)) for r in every_log_record.records
             if getattr(r, "consumer_kit_fields", None)]
    [executed] = [line for line in lines if line["outcome"] == "executed"]
    assert executed["correlation_id"] == "corr-marker"
    assert executed["operation_key"] == "order-418-rev-2" and len(executed["event_ids"]) == 1
    [conflict] = [line for line in lines if line["outcome"] == "payload_conflict"]
    assert conflict["reason"] == "payload_conflict" and conflict["message_id"]


def test_descriptions_name_no_values() -> None:
    class Diag:
        message_primary = 'invalid input syntax for type integer: "Jane Doe"'

    class DataError(Exception):
        sqlstate = "22P02"
        diag = Diag()

    assert describe_error(DataError()) == 'DataError [22P02] invalid input syntax for type integer: "?"'
    try:
        try:
            int("Jane Doe")
        except ValueError as exc:
            raise RuntimeError("wrapping Jane Doe") from exc
    except RuntimeError as exc:
        text = describe_traceback(exc)
    assert "Jane" not in text
    assert "builtins.ValueError" in text and "builtins.RuntimeError" in text and "test_telemetry.py" in text


def test_the_catalogue_names_each_metric_once_with_a_unit() -> None:
    names = [spec.name for spec in CATALOGUE]
    assert len(names) == len(set(names))
    assert all(spec.unit and spec.kind in {"counter", "histogram", "gauge"} for spec in CATALOGUE)
    assert {spec.name for spec in CATALOGUE} >= set(OUTCOME_COUNTERS.values())


async def test_psycopg_data_errors_are_described_without_the_value(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InvalidTextRepresentation) as caught:
            await conn.execute("SELECT %s::integer", ("Jane Doe",))
    assert "Jane" in str(caught.value)
    assert "Jane" not in describe_error(caught.value)
