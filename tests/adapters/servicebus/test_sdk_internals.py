"""Every private field of azure-servicebus the adapter reads or writes, checked on the SDK installed.

The adapter touches five (``grep -n '\\._[a-z]' adapters/servicebus``): a received message's
``_expiry`` and a session's ``_locked_until_utc`` (rewritten on the host's clock, lock_clock.py), a
message's ``_is_deferred_message`` (settle by lock token, delivery.py), a sender's
``_max_message_size_on_link`` (limits.py) and an error's ``_condition`` (errors.py). Most are read
with ``getattr``/``hasattr`` fallbacks that would turn a rename into silent misbehaviour (a lock
thought lost, a settlement on the wrong link, an unmeasured batch), so a rename must fail here:
``.ci/run`` runs this file on the lowest and highest azure-servicebus the package allows."""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect

from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusReceiver
from azure.servicebus.exceptions import ServiceBusError

from consumer_kit.adapters.servicebus.errors import is_refusal
from consumer_kit.adapters.servicebus.limits import link_message_limit
from tests.adapters.servicebus.server.fixtures import SBEnv

SDK_CALL = 20.0  # seconds: every SDK call is bounded (an unanswered one hangs)


async def test_a_received_message_keeps_its_lock_expiry_in_expiry(sb: SBEnv) -> None:
    sb.create_queue(lock_duration=30)
    await sb.send(ServiceBusMessage(b"x"))
    async with asyncio.timeout(SDK_CALL), sb.receiver(sb.queue) as receiver:
        [message] = await receiver.receive_messages(max_message_count=1, max_wait_time=5)
        assert message._expiry is not None or message.locked_until_utc is not None
        moved = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
        message._expiry = moved
        assert message.locked_until_utc == moved  # the SDK's own lock checks read this field
        assert message._is_deferred_message is False
        # the SDK settles a message flagged deferred over $management by lock token
        source = inspect.getsource(ServiceBusReceiver._settle_message)
        assert "_is_deferred_message" in source and "_settle_message_via_mgmt_link" in source
        message._expiry = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)
        await receiver.complete_message(message)


async def test_a_session_keeps_its_lock_expiry_in_locked_until_utc(sb: SBEnv) -> None:
    sb.create_queue(lock_duration=30, requires_session=True)
    await sb.send(ServiceBusMessage(b"x", session_id="s1"))
    async with asyncio.timeout(SDK_CALL), sb.receiver(sb.queue, session_id="s1") as receiver:
        session = receiver.session
        assert session._locked_until_utc == session.locked_until_utc and session.locked_until_utc is not None
        moved = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
        session._locked_until_utc = moved
        assert session.locked_until_utc == moved and not session.auto_renew_error


async def test_an_open_sender_keeps_the_link_limit_in_max_message_size_on_link(sb: SBEnv) -> None:
    sb.create_queue()
    async with asyncio.timeout(SDK_CALL), sb.client.get_queue_sender(sb.queue) as sender:
        await sender.send_messages(ServiceBusMessage(b"x"))  # opens the link
        assert "_max_message_size_on_link" in vars(sender)
        assert link_message_limit(sender) > 0


def test_an_error_keeps_its_amqp_condition_in_condition() -> None:
    # the message text does not name the condition: only the private field tells a refusal
    error = ServiceBusError("refused", condition=b"amqp:not-allowed")
    assert error._condition == "amqp:not-allowed"
    assert is_refusal(error) and not is_refusal(ServiceBusError("refused"))
