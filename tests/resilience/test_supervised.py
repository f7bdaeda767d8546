"""Supervised background tasks (``consumer_kit.resilience.supervised``): a receive, renewal or probe task that
dies is logged, restarted, and keeps the worker not ready until it runs again.

The per-broker receive tasks are killed the same way at the end of each run of
``tests/system/hostile/test_bookkeeping_headers.py`` (RabbitMQ, SQS, Service Bus, memory)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest

from consumer_kit import App, DeliveryReport, Settings
from consumer_kit.adapters.memory import get_broker
from consumer_kit.resilience import supervised
from consumer_kit.resilience.supervised import Supervised
from consumer_kit.worker.process import Worker
from tests.fixtures.harness import throwaway_schema
from tests.pipeline.test_faults_and_attempts import http_status
from tests.system.hostile.corpus import GOOD_BYTES, TABLES, PlaceOrderHandler


async def test_a_task_that_dies_is_logged_reported_down_and_restarted(caplog: pytest.LogCaptureFixture) -> None:
    runs: asyncio.Queue[int] = asyncio.Queue()
    count = 0

    async def dies_twice() -> None:
        nonlocal count
        count += 1
        runs.put_nowait(count)
        if count <= 2:
            raise ValueError("a malformed something")
        await asyncio.Event().wait()  # the third run stays up

    caplog.set_level(logging.ERROR, "consumer_kit.supervised")
    task = Supervised("test receive loop", dies_twice, first_pause=0.01).start()
    try:
        assert [await asyncio.wait_for(runs.get(), 5) for _ in range(3)] == [1, 2, 3]
        await asyncio.wait_for(task.started.wait(), 5)
        assert task.running and task.deaths == 2 and task.restarts == 2
        died = [r for r in caplog.records if "test receive loop died (ValueError)" in r.getMessage()]
        assert len(died) == 2 and all(r.exc_info for r in died)  # with the traceback
        assert "a malformed something" not in died[0].getMessage()  # the text may quote a payload
    finally:
        await task.stop()
    assert not task.running


async def test_a_task_that_returns_has_finished_its_job() -> None:
    async def probe_once() -> None:
        return None

    task = Supervised("test probe", probe_once).start()
    await task.wait_finished(5)
    assert task.finished and task.deaths == 0 and supervised.all_running([task])
    assert task not in supervised.find("test probe")


async def test_inject_kills_it_from_inside_and_the_restart_can_be_held() -> None:
    cleaned_up = asyncio.Event()

    async def loop() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned_up.set()  # the coroutine itself unwinds, as under a real exception

    task = Supervised("test loop", loop, first_pause=0.01).start()
    try:
        await asyncio.wait_for(task.started.wait(), 5)
        await asyncio.sleep(0)  # let the first run reach its wait
        release = asyncio.Event()
        task.inject(RuntimeError("injected"), hold=release)
        await asyncio.wait_for(task.died.wait(), 5)
        assert cleaned_up.is_set() and task.deaths == 1
        assert not task.running and not supervised.all_running([task])
        release.set()
        await asyncio.wait_for(task.started.wait(), 5)
        assert task.running and task.restarts == 1
    finally:
        await task.stop()


async def test_stop_from_inside_the_run_does_not_wait_for_itself() -> None:
    holder: list[Supervised] = []

    async def stops_itself() -> None:
        await holder[0].stop()
        await asyncio.Event().wait()  # cancelled by the stop above

    task = Supervised("test self stop", stops_itself)
    holder.append(task)
    task.start()
    await asyncio.wait_for(asyncio.shield(_ended(task)), 5)
    assert task.deaths == 0


async def _ended(task: Supervised) -> None:
    while task.running:
        await asyncio.sleep(0.01)  # polling the task's observable state


@pytest.mark.postgres
async def test_the_worker_answers_503_while_its_receive_task_is_down(database_url: str) -> None:
    url = f"memory://supervised-{uuid.uuid4().hex[:8]}"
    queue = "supervised"
    async with throwaway_schema(database_url, example_tables=False) as schema:
        await _create_tables(database_url, schema)
        app = App("supervised")
        app.subscribe(queue, PlaceOrderHandler())
        reports: asyncio.Queue[DeliveryReport] = asyncio.Queue()
        settings = Settings(database_url=database_url, db_schema=schema, search_path=schema, broker_url=url,
                            health_port=0)
        worker = Worker(app, settings, on_report=reports.put_nowait)
        run = asyncio.create_task(worker.run())
        try:
            await asyncio.wait_for(worker.started.wait(), 30)
            assert worker.health.port is not None
            assert await http_status(worker.health.port, "/ready") == 200
            [receiver] = supervised.find(f"memory-pump:{queue}")
            release = asyncio.Event()
            receiver.inject(RuntimeError("injected by the test"), hold=release)
            await asyncio.wait_for(receiver.died.wait(), 10)
            assert await http_status(worker.health.port, "/ready") == 503
            assert await http_status(worker.health.port, "/live") == 200  # alive: nothing to restart
            release.set()
            await asyncio.wait_for(receiver.started.wait(), 10)
            assert await http_status(worker.health.port, "/ready") == 200
            get_broker(url).send(queue, GOOD_BYTES, headers={"operation-id": "after-restart"})
            report = await asyncio.wait_for(reports.get(), 30)
            assert (report.operation_key, report.outcome.value) == ("after-restart", "executed")
        finally:
            worker.stop()
            await asyncio.wait_for(run, 30)


async def _create_tables(database_url: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        await conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        await conn.execute(TABLES.encode())





# -- the one guard around building a delivery -------------------------------------------------------


def test_build_delivery_turns_any_failure_into_the_adapters_dead_letter(caplog: pytest.LogCaptureFixture) -> None:
    from consumer_kit.broker import build_delivery

    def unmappable() -> Any:
        raise RecursionError("maximum recursion depth exceeded (payload text)")

    fallbacks: list[str] = []
    assert build_delivery(unmappable, unbuildable=fallbacks.append, what="queue=q message_id=m") is None
    assert fallbacks == ["the message could not be mapped (RecursionError)"]  # no exception text
    assert "queue=q message_id=m" in caplog.text

    def failing_fallback(_detail: str) -> None:
        raise OSError("broker gone")

    assert build_delivery(unmappable, unbuildable=failing_fallback, what="queue=q") is None  # never raises


async def test_a_message_the_memory_adapter_cannot_map_is_dead_lettered_and_the_next_runs() -> None:
    from consumer_kit.adapters.memory import MemoryConsumer, StoredMessage

    class Unmappable(StoredMessage):
        @property  # type: ignore[override]
        def deliveries(self) -> int:
            raise ValueError("cannot map")

        @deliveries.setter
        def deliveries(self, value: int) -> None:
            raise ValueError("cannot map")

    broker = get_broker(f"memory://guard-{uuid.uuid4().hex[:8]}")
    consumer = MemoryConsumer(broker)
    received: asyncio.Queue[Any] = asyncio.Queue()

    async def callback(delivery: Any) -> None:
        received.put_nowait(delivery)
        await delivery.ack()

    bad = StoredMessage(b"{}", "bad", {})
    bad.__class__ = Unmappable  # its broker-side count now fails, as a mapping that raises would
    broker._outstanding += 1
    broker._enqueue("guarded", bad)
    broker.send("guarded", b"{}", message_id="good")
    await consumer.subscribe("guarded", callback, prefetch=2)
    try:
        delivery = await asyncio.wait_for(received.get(), 10)
        assert delivery.message_id == "good"
        [dead] = broker.dead_letters("guarded")
        assert (dead.message.message_id, dead.reason) == ("bad", "invalid_header")
        assert "ValueError" in dead.detail
        assert consumer.ready and [t.deaths for t in supervised.find("memory-pump:guarded")] == [0]
    finally:
        await consumer.close()
