"""One timer for a delivery's bounded steps (consumer_kit.db.deadlines): each step still overruns
as under ``asyncio.timeout``, nested and in sequence, and a healthy sequence keeps one timer."""

from __future__ import annotations

import asyncio

import pytest

from consumer_kit.db.deadlines import DeliveryClock, Step, overran, step_bound
from consumer_kit.db.pool import bounded
from consumer_kit.errors import StatementTimeout


async def test_steps_in_sequence_share_one_timer_and_an_overrun_is_a_statement_timeout() -> None:
    with DeliveryClock() as clock:
        async with bounded(30, "the claim"):
            handle = clock.handle
            assert handle is not None
        async with bounded(60, "the handler"):  # a later deadline: the timer stays
            assert clock.handle is handle
        async with bounded(30, "the completion"):
            assert clock.handle is handle
        with pytest.raises(StatementTimeout, match=r"COMMIT did not answer within 0\.05 s"):
            async with bounded(0.05, "COMMIT"):  # an earlier deadline moves the timer
                assert clock.handle is not handle
                await asyncio.sleep(30)
    assert clock.handle is None and not clock.steps


async def test_a_step_past_an_early_firing_timer_is_not_cut_short() -> None:
    with DeliveryClock() as clock:
        async with bounded(0.01, "the claim"):
            pass
        async with bounded(30, "the handler"):
            await asyncio.sleep(0.05)  # the claim's timer fires inside this step: re-armed, no timeout
            assert clock.handle is not None and clock.handle.when() >= clock.steps[0].deadline - 1e-6


async def test_nested_steps_expire_each_at_its_own_deadline() -> None:
    with DeliveryClock():
        outer = step_bound(0.2)
        assert isinstance(outer, Step)
        with pytest.raises(TimeoutError):
            async with outer:
                inner = step_bound(0.02)
                with pytest.raises(TimeoutError):
                    async with inner:
                        await asyncio.sleep(30)
                assert overran(inner) and not overran(outer)
                await asyncio.sleep(30)
        assert overran(outer)


async def test_a_cancellation_from_outside_is_not_a_timeout() -> None:
    started = asyncio.Event()

    async def delivery() -> None:
        with DeliveryClock():
            async with bounded(30, "the claim"):
                started.set()
                await asyncio.sleep(30)

    task = asyncio.create_task(delivery())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_timeout_error_of_the_block_itself_propagates_as_it_is() -> None:
    with DeliveryClock():
        with pytest.raises(TimeoutError, match="the handler's own"):
            async with bounded(30, "the claim"):
                raise TimeoutError("the handler's own")


async def test_a_step_in_another_task_gets_a_timeout_of_its_own() -> None:
    with DeliveryClock() as clock:

        async def elsewhere() -> None:
            scope = step_bound(0.02)
            assert isinstance(scope, asyncio.Timeout)
            async with bounded(0.02, "the marker"):
                await asyncio.sleep(30)

        with pytest.raises(StatementTimeout):
            await asyncio.create_task(elsewhere())  # the task copied the context with the clock
        assert clock.handle is None  # the clock's own task armed nothing
