"""Throttling injected by a test: the next N operations of one kind on one entity answer "server busy".

Service Bus answers a throttled request with the AMQP error condition ``com.microsoft:server-busy``
(azure-servicebus 7.15 ``_common/constants.py``: ``ERROR_CODE_SERVER_BUSY = VENDOR +
b":server-busy"``, mapped to ``ServiceBusServerBusyError`` in ``_transport/_pyamqp_transport.py``,
an error the SDK marks ``retryable=True, shutdown_handler=False`` in ``exceptions.py``, and backs off
4 s for in its own retry policy). Microsoft's *Throttling operations on Azure Service Bus*: a
Standard namespace has 1000 credits a second; Send, Receive and Peek cost one credit per message,
management operations 10; past them "the request was terminated because the entity is being
throttled. Error code: 50009. Please wait 2 seconds and try again." (the message this module
sends). The condition itself is seen in public client logs of throttled sends (``[condition =
com.microsoft:server-busy]``).

How each kind is answered here (the wire form of a throttled receive and settlement is not
documented; these are the only AMQP ways to refuse them, and what the SDK maps):

==========  ===================================================================================
kind        answer
==========  ===================================================================================
send        the transfer is ``rejected`` with ``com.microsoft:server-busy``; nothing is stored
            (a ``schedule-message`` request answers status 503 with that condition)
receive     the credit the receiver issues is not served: its link is detached with
            ``com.microsoft:server-busy``. Message locks stay (they belong to the entity, not to
            the link, and lapse on their own): messages already handed out can still be settled
            by ``$management update-disposition``, which the SDK falls back to once the link
            is gone
settle      a disposition is ``rejected`` with ``com.microsoft:server-busy`` and not applied
            (the message stays locked); an ``update-disposition`` request answers 503
peek        a ``peek-message`` request answers 503 with ``com.microsoft:server-busy``
renew       a ``renew-lock`` / ``renew-session-lock`` request answers 503
==========  ===================================================================================

Never seen on a real namespace: which of these Azure throttles besides send, receive and peek
(the page lists only those as data operations), and whether a throttled receive detaches the link
or only delays it.
"""

from __future__ import annotations

import threading
from collections import Counter

from proton import Message, symbol

from . import wire
from .errors import BrokerError

SERVER_BUSY = "com.microsoft:server-busy"

KINDS = frozenset({"send", "receive", "settle", "peek", "renew"})

# $management operations and the kind of throttle that answers them.
MANAGEMENT_KINDS = {
    "com.microsoft:update-disposition": "settle",
    "com.microsoft:peek-message": "peek",
    "com.microsoft:schedule-message": "send",
    "com.microsoft:renew-lock": "renew",
    "com.microsoft:renew-session-lock": "renew",
}


class ServerBusy(BrokerError):
    """Service Bus is throttling the entity (``ServiceBusServerBusyError`` in the SDK)."""

    condition = SERVER_BUSY
    status_code = 503

    def __init__(self, path: str) -> None:
        super().__init__(
            f"The request was terminated because the entity {path} is being throttled. "
            "Error code: 50009. Please wait 2 seconds and try again."
        )


class Throttles:
    """Per entity and kind: how many operations are still to be refused, how many were refused.

    Entity paths compare case-insensitively, as Service Bus names do; a dead-letter queue is its
    own path (``q/$DeadLetterQueue``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Counter[tuple[str, str]] = Counter()
        self._refused: Counter[tuple[str, str]] = Counter()

    def add(self, path: str, kind: str, count: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown throttle kind {kind!r} (one of {sorted(KINDS)})")
        if count < 0:
            raise ValueError("count must be >= 0")
        with self._lock:
            self._pending[(path.casefold(), kind)] = count

    def take(self, path: str, kind: str) -> bool:
        """True (and one fewer left) when this operation is to be refused as throttled."""
        key = (path.casefold(), kind)
        with self._lock:
            if self._pending[key] <= 0:
                return False
            self._pending[key] -= 1
            self._refused[key] += 1
            return True

    def check(self, path: str, kind: str) -> None:
        """Raise :class:`ServerBusy` when this operation is to be refused as throttled."""
        if self.take(path, kind):
            raise ServerBusy(path)

    def pending(self, path: str, kind: str) -> int:
        with self._lock:
            return self._pending[(path.casefold(), kind)]

    def refused(self, path: str, kind: str) -> int:
        with self._lock:
            return self._refused[(path.casefold(), kind)]

    def management_busy(self, path: str, request: Message) -> Message | None:
        """The 503 ``server-busy`` answer to a ``$management`` request on ``path`` when its kind
        (:data:`MANAGEMENT_KINDS`) is throttled, else ``None`` (the request is served)."""
        operation = wire.as_text((request.properties or {}).get("operation")) or ""
        kind = MANAGEMENT_KINDS.get(operation)
        if kind is None or not self.take(path, kind):
            return None
        properties = {
            "statusCode": ServerBusy.status_code,
            "statusDescription": str(ServerBusy(path)),
            "errorCondition": symbol(SERVER_BUSY),
        }
        return Message(correlation_id=request.id, properties=properties, body=None)
