"""The bookkeeping-header matrix: every header consumer-kit reads, with every kind of bad value.

Each broker's test (``test_bookkeeping_headers.py``) sends one message per (header, bad value)
through a real worker, then one healthy message, and checks each against :func:`expected`: the
table of :mod:`consumer_kit.codec.headers` restated here on its own (a header's verdict and what a good
value of it looks like), so the test does not ask the codec what the codec says.

What each broker can carry differs: its test maps a bad value onto what its producers can send
(:class:`Carry`), and :func:`expected` judges the value as the consumer will receive it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import unicodedata
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from consumer_kit import App, DeliveryReport, Settings
from consumer_kit.broker import Consumer
from consumer_kit.resilience import supervised
from consumer_kit.testing.outcomes import TERMINAL_OUTCOMES
from consumer_kit.worker.process import Worker
from tests.fixtures.harness import fetch_all, throwaway_schema
from tests.system.hostile.corpus import GOOD_BYTES, TABLES, PlaceOrderHandler

NESTING = 10_000
HUGE = 1_000_000

# header -> (kind, verdict, max characters of a text); verdict: "ignored", "invalid" or "key"
# (operation-id: the decoder's missing/invalid_operation_key)
TABLE: dict[str, tuple[str, str, int]] = {
    "x-consumer-kit-deliveries": ("count", "ignored", 0),
    "x-consumer-kit-redelivered": ("flag", "ignored", 0),
    "x-delivery-count": ("count", "ignored", 0),
    "x-consumer-kit-trimmed-headers": ("count", "ignored", 0),
    "x-consumer-kit-message-id": ("text", "invalid", 512),
    "x-consumer-kit-headers": ("packed", "invalid", 0),
    "x-consumer-kit-redriven": ("text", "ignored", 1024),
    "x-dead-letter-reason": ("text", "ignored", 1024),
    "x-dead-letter-detail": ("text", "ignored", 4096),
    "x-original-queue": ("text", "ignored", 1024),
    "x-consumer-kit-first-enqueued": ("time", "ignored", 64),
    "x-consumer-kit-sender": ("text", "ignored", 255),
    "x-consumer-kit-mac": ("text", "ignored", 64),
    "operation-id": ("text", "key", 512),
    "tenant-id": ("text", "invalid", 200),
    "message-type": ("text", "invalid", 256),
    "operation-created-at": ("time", "invalid", 64),
    "partition-key": ("text", "invalid", 512),
    "correlation-id": ("text", "ignored", 256),
}


def nested(depth: int = NESTING) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def nested_json(depth: int = NESTING) -> str:
    return "[" * depth + "1" + "]" * depth


BAD_KINDS: dict[str, Callable[[str], Any]] = {
    # a count gets text, anything else a number
    "wrong_type": lambda header: "three" if TABLE[header][0] in ("count", "flag") else 7,
    "negative": lambda _header: -1,
    "non_finite": lambda _header: float("inf"),
    "two_pow_63_int": lambda _header: 2**63,
    "two_pow_63_float": lambda _header: float(2**63),
    "two_pow_63_text": lambda _header: str(2**63),
    "two_pow_63_bytes": lambda _header: str(2**63).encode(),
    "nested": lambda _header: nested(),
    "nested_text": lambda _header: nested_json(),
    "huge": lambda _header: "9" * HUGE,
    "undecodable": lambda _header: b"\xff\xfe\xfa",
}


@dataclass(frozen=True)
class Case:
    index: int
    header: str
    kind: str
    value: Any  # as sent

    @property
    def operation_id(self) -> str:
        return f"bk-{self.index}"

    def headers(self) -> dict[str, Any]:
        """The message's headers: its case number, a message type and a key of its own, then the
        bad value."""
        headers: dict[str, Any] = {CASE_HEADER: str(self.index), "message-type": "PlaceOrder",
                                   "operation-id": self.operation_id}
        headers[self.header] = self.value
        return headers


CASE_HEADER = "x-test-case"

Carry = Callable[[str, Any], Any]
"""``(kind, value) -> value`` a broker's producer can send, or :data:`SKIP`."""
SKIP = object()


def cases(carry: Carry) -> list[Case]:
    """One case per header and kind of bad value that ``carry`` can send."""
    made: list[Case] = []
    for header in TABLE:
        for kind, make in BAD_KINDS.items():
            value = carry(kind, make(header))
            if value is not SKIP:
                made.append(Case(len(made), header, kind, value))
    return made


def expected(header: str, received: Any) -> str:
    """``"executed"``, ``"dead:invalid_header"`` or ``"dead:invalid_operation_key"`` for
    ``received`` (the value as the consumer gets it) in ``header``."""
    kind, verdict, max_chars = TABLE[header]
    if _good(kind, received, max_chars):
        return "dead:unknown_message_type" if header == "message-type" else "executed"
    if verdict == "ignored":
        return "executed"
    return "dead:invalid_operation_key" if verdict == "key" else "dead:invalid_header"


def _good(kind: str, value: Any, max_chars: int) -> bool:
    if kind == "count":
        return (type(value) is int and 0 <= value < 2**31) or (isinstance(value, str | bytes) and value.isdigit() and len(value) <= 9)
    if kind == "flag":
        return value in (1, "1", b"1") and type(value) is not float
    if kind == "packed":
        try:
            loaded = json.loads(value) if isinstance(value, str) else None
        except (ValueError, RecursionError):
            return False
        return isinstance(loaded, dict) and all(isinstance(v, str) for v in loaded.values())
    text = _text(value)
    if text is None or len(text) > max_chars:
        return False
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in text):
        return False
    if kind == "time":
        try:
            return dt.datetime.fromisoformat(text).tzinfo is not None
        except ValueError:
            return False
    return True


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


HEALTHY_KEY = "bk-healthy"

DeadLetters = Callable[[int], Awaitable[list[tuple[str, str, str]]]]
"""``(count) -> [(x-test-case, reason, detail)]``: read that many dead letters of the queue."""


@dataclass
class Broker:
    """How one broker's test runs the matrix.

    Attributes:
        settings: the worker's broker settings (``broker_url`` and its options).
        consumer: a consumer to use (``None``: the worker opens one from ``settings``).
        send: sends ``(headers, body)`` to the queue.
        dead_letters: reads the queue's dead letters.
        received: ``(value as sent) -> value as the consumer gets it``.
        carry: which bad values this broker's producers can send, and how.
    """

    queue: str
    settings: dict[str, Any]
    send: Callable[[dict[str, Any], bytes], Awaitable[None]]
    dead_letters: DeadLetters
    carry: Carry
    received: Callable[[Any], Any] = lambda value: value
    consumer: Consumer | None = None
    receive_task: str = ""
    """Part of the name of the queue's supervised receive task (:func:`consumer_kit.resilience.supervised.find`),
    killed once from inside after the matrix."""


async def run_matrix(database_url: str, broker: Broker) -> list[Case]:
    """Run every case through one worker on ``broker``, then a healthy message, and check them
    (module docstring). Returns the cases run."""
    matrix = cases(broker.carry)
    async with throwaway_schema(database_url, example_tables=False) as schema:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
            await conn.execute(TABLES.encode())
        settings = Settings(
            database_url=database_url, db_schema=schema, search_path=schema, retry_delays=[0.05],
            in_progress_delay=0.05, max_deliveries=3, concurrency=8, **broker.settings,
        )
        app = App("bookkeeping")
        app.subscribe(broker.queue, PlaceOrderHandler())
        reports: list[DeliveryReport] = []
        arrived = asyncio.Event()

        def on_report(report: DeliveryReport) -> None:
            reports.append(report)
            arrived.set()

        worker = Worker(app, settings, consumer=broker.consumer, on_report=on_report)
        task = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.started.wait(), 30)
            for case in matrix:
                await broker.send(case.headers(), GOOD_BYTES)
            await broker.send({"message-type": "PlaceOrder", "operation-id": HEALTHY_KEY}, GOOD_BYTES)
            async with asyncio.timeout(120):
                while sum(r.outcome in TERMINAL_OUTCOMES for r in reports) < len(matrix) + 1:
                    arrived.clear()
                    await arrived.wait()
            await _check(database_url, schema, broker, matrix, reports)
            assert worker.health.ready, "the worker stayed ready"
            died = [t.name for t in supervised.find("consumer-kit") + supervised.find("memory-pump") if t.deaths]
            assert died == [], f"no receive task died: {died}"
            assert not task.done()
            if broker.receive_task:
                await _kill_and_watch(broker, worker, reports, arrived)
        finally:
            worker.stop()
            await asyncio.wait_for(task, 60)
    return matrix


async def _check(database_url: str, schema: str, broker: Broker, matrix: list[Case], reports: list[DeliveryReport]) -> None:
    want = {case.index: expected(case.header, broker.received(case.value)) for case in matrix}
    rows = await fetch_all(database_url, schema, "SELECT operation_key, count(*) FROM effects GROUP BY 1")
    ran = dict(rows)
    assert all(n == 1 for n in ran.values()), f"run at most once: {rows}"
    assert ran.get(HEALTHY_KEY) == 1, "the healthy message after them ran"
    executed = {case.index for case in matrix if want[case.index] == "executed"}
    by_key = {case.operation_id: case.index for case in matrix if case.header != "operation-id"}
    ran_cases = {by_key[key] for key in ran if key in by_key}
    ran_cases |= {c.index for c in matrix if c.header == "operation-id" and want[c.index] == "executed"}
    assert ran_cases == executed, "ran exactly the cases whose value is good or ignored: " + _names(
        matrix, ran_cases ^ executed, want)
    dead_wanted = [case for case in matrix if want[case.index].startswith("dead:")]
    letters = await broker.dead_letters(len(dead_wanted))
    got = {int(case): (reason, detail) for case, reason, detail in letters}
    for case in dead_wanted:
        assert case.index in got, f"dead-lettered: {case.header} {case.kind}"
        reason, detail = got[case.index]
        assert f"dead:{reason}" == want[case.index], (case.header, case.kind, reason, detail)
        if reason != "unknown_message_type":
            assert case.header in detail, (case.header, case.kind, detail)
    assert len(letters) == len(dead_wanted), "nothing else dead-lettered"
    assert sum(r.outcome in TERMINAL_OUTCOMES for r in reports) == len(matrix) + 1, "each settled once"


async def _kill_and_watch(broker: Broker, worker: Worker, reports: list[DeliveryReport], arrived: asyncio.Event) -> None:
    """Kill the receive task with an injected exception: not ready while it is down, ready again
    once restarted, and a message sent then runs."""
    [receiver] = supervised.find(broker.receive_task)
    release = asyncio.Event()
    receiver.inject(RuntimeError("injected by the test"), hold=release)
    await asyncio.wait_for(receiver.died.wait(), 10)
    assert not receiver.running and not worker.health.ready, "not ready while the receive task is down"
    release.set()
    await asyncio.wait_for(receiver.started.wait(), 10)
    assert receiver.restarts == 1 and receiver.running
    async with asyncio.timeout(30):
        while not worker.health.ready:  # the adapter's own connection state may lag a moment
            await asyncio.sleep(0.05)
    before = len(reports)
    await broker.send({"message-type": "PlaceOrder", "operation-id": "bk-after-restart"}, GOOD_BYTES)
    async with asyncio.timeout(30):
        while not any(r.operation_key == "bk-after-restart" for r in reports[before:]):
            arrived.clear()
            await arrived.wait()
    assert [r.outcome.value for r in reports[before:] if r.operation_key == "bk-after-restart"] == ["executed"]


def _names(matrix: list[Case], indexes: set[int], want: dict[int, str]) -> str:
    return ", ".join(f"{matrix[i].header}/{matrix[i].kind}->{want[i]}" for i in sorted(indexes))
