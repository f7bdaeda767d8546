"""Throttling: Service Bus's "server busy" waited out with backoff, never a fault of a message.

A Standard namespace throttles past its credits (Microsoft, *Throttling operations on Azure Service
Bus*: 1000 credits a second per namespace, one per message sent, received or peeked; "Please wait 2
seconds and try again"). On AMQP the answer carries ``com.microsoft:server-busy``, which
azure-servicebus raises as ``ServiceBusServerBusyError`` (7.15 ``_common/constants.py``
``ERROR_CODE_SERVER_BUSY``; ``exceptions.py``: ``retryable=True, shutdown_handler=False``). The
SDK's own retries are off here (``retry_total=0``, :mod:`~consumer_kit.adapters.servicebus.connection`),
so consumer-kit waits instead:

* a throttled **settlement** (complete, abandon, dead-letter) is made again on the same
  receiver after :data:`THROTTLE_BACKOFF`, within the settlement's own bound (``settle_timeout``):
  the message keeps its lock, its attempt and its count;
* a throttled **send** of the relay's publisher (a batch, a retry or release copy) is sent again
  after the backoff, within the publish's ``confirm_timeout``;
* a throttled **peek** of ``consumer-kit dlq`` is made again, within its call timeout;
* a throttled **receive** makes the pump wait the backoff before it receives again
  (:mod:`~consumer_kit.adapters.servicebus.subscription`);
* a throttled **lock renewal** (message or session) is tried again by the lock keeper at its
  next turn, well before the lock lapses.

Each wait is counted ``throttled`` (consumers) and logged with ids only.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from azure.servicebus.exceptions import ServiceBusServerBusyError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from consumer_kit.broker.kit.counters import Counters
from consumer_kit.resilience.backoff import Backoff

logger = logging.getLogger(__name__)

T = TypeVar("T")

THROTTLED = (ServiceBusServerBusyError,)
"""What Service Bus raises when it throttles (``com.microsoft:server-busy``)."""


THROTTLE = Backoff(first=0.5, cap=8.0)
"""After the n-th throttled call in a row: 0.5 s, 1 s, 2 s (Azure's advice), ... at most 8 s. Each
caller's own timeout bounds the whole, so a throttle that outlasts it fails the call as before."""


def backoff_seconds(attempt: int) -> float:
    """Seconds to wait after the ``attempt``-th throttled call in a row (1, 2, ...)."""
    return THROTTLE.delay(attempt)


THROTTLE_BACKOFF = THROTTLE.wait()
""":data:`THROTTLE` as a tenacity wait."""


def is_throttled(exc: BaseException | None) -> bool:
    return isinstance(exc, THROTTLED)


async def while_throttled(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    counters: Counters | None = None,
) -> T:
    """Await ``call()``; while it raises :data:`THROTTLED`, wait :data:`THROTTLE_BACKOFF` and call
    again (unbounded: the caller bounds it with its own timeout). Any other error is raised at once.
    ``what`` names the operation in the log line (ids only, never payloads); ``counters`` counts
    each throttled call as ``throttled``."""

    def note(state: RetryCallState) -> None:
        if counters is not None:
            counters.add("throttled")
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning("Service Bus throttled %s (server busy): trying again in %.1fs", what, wait)

    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(THROTTLED), wait=THROTTLE_BACKOFF, before_sleep=note, reraise=True
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover
