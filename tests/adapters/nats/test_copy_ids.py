"""The copies the NATS adapter makes carry a ``Nats-Msg-Id`` no producer can predict, and a publish
ack that answers one of them as a duplicate is never taken for a stored copy
(:mod:`consumer_kit.broker.kit.copy_ids`, docs/brokers/nats.md "Copies").

The attack: a producer who may publish on the queue's subjects reads the stream's next sequence
number and publishes junk under the ids the adapter used to give its copies
(``<stream>-<sequence>-<why>``); JetStream's duplicate window then drops the real copy while the
original is settled, and the message vanishes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from consumer_kit import Outcome
from consumer_kit.adapters.nats.topology import dead_letter_subject
from consumer_kit.broker.kit import copy_ids
from tests.adapters.contract.conftest import Contract, contract  # noqa: F401 - fixture
from tests.adapters.contract.nats_driver import NATSDriver, nats_url  # noqa: F401 - fixture
from tests.adapters.contract.test_contract import StuckHandler
from tests.fixtures.broker_env import command

pytestmark = pytest.mark.parametrize("contract", ["nats"], indirect=True)


async def _next_sequence(driver: NATSDriver) -> int:
    js = await driver.connection.jetstream()
    return int((await js.stream_info(driver.stream)).state.last_seq or 0) + 1


async def _seed(driver: NATSDriver, subject: str, msg_id: str) -> None:
    js = await driver.connection.jetstream()
    ack = await js.publish(subject, b"junk", headers={"Nats-Msg-Id": msg_id})
    assert not ack.duplicate


async def test_a_dead_letter_copy_cannot_be_pre_empted_by_a_producer(contract: Contract) -> None:  # noqa: F811
    driver = contract.driver
    assert isinstance(driver, NATSDriver)
    await driver.consumer(contract.settings())  # declares the streams
    seq = await _next_sequence(driver)
    await _seed(driver, dead_letter_subject(driver.queue), f"{driver.stream}-{seq}-dead_letter")
    async with contract.worker():
        message_id = await driver.send(b"{not json")
        report = await contract.next_report()
    assert report.outcome is Outcome.INVALID
    letters = await driver.dead_letters(2)
    real = [letter for letter in letters if letter.message_id == message_id]
    assert [(letter.reason, letter.body) for letter in real] == [("invalid_json", b"{not json")]
    assert await driver.depth() == 0


async def test_a_released_copy_cannot_be_pre_empted_by_a_producer(contract: Contract) -> None:  # noqa: F811
    driver = contract.driver
    assert isinstance(driver, NATSDriver)
    await driver.consumer(contract.settings())
    seq = await _next_sequence(driver) + 1  # the junk itself takes the next sequence number
    await _seed(driver, f"{driver.queue}.k.junk", f"{driver.stream}-{seq}-release")
    handler = StuckHandler()
    async with contract.worker(handler, shutdown_timeout=0.5):
        message_id = await driver.send(command())
        await asyncio.wait_for(handler.entered.wait(), 20)
    async with contract.worker():
        reports = await contract.reports_until(lambda seen: any(r.message_id == message_id for r in seen))
    ran = [r for r in reports if r.message_id == message_id]
    assert [r.outcome for r in ran] == [Outcome.EXECUTED]
    assert await contract.rows("SELECT count(*) FROM invoices") == [(1,)]


async def test_a_copy_answered_as_a_duplicate_is_given_back_not_settled(
    contract: Contract, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """An id used before (here: forced to collide with one already stored) means someone else
    stored under it: the delivery is given back and runs again, never acked as if copied."""
    driver = contract.driver
    assert isinstance(driver, NATSDriver)
    await driver.consumer(contract.settings())
    await _seed(driver, dead_letter_subject(driver.queue), "0" * copy_ids.ID_CHARS)
    ids: list[Any] = ["0" * copy_ids.ID_CHARS]

    def colliding_once() -> str:
        return ids.pop() if ids else copy_ids.secrets.token_hex(copy_ids.ID_CHARS // 2)

    monkeypatch.setattr("consumer_kit.adapters.nats.delivery.random_copy_id", colliding_once)
    async with contract.worker():
        message_id = await driver.send(b"{not json")
        letters = await driver.dead_letters(2)
    real = [letter for letter in letters if letter.message_id == message_id]
    assert [letter.reason for letter in real] == ["invalid_json"]
    assert not ids  # the colliding id was used, and the copy made again under a fresh one
