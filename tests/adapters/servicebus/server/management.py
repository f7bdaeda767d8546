"""The ``<entity>/$management`` node: Service Bus's request/response operations.

The SDK sends a request (AMQP value body: a map) with application properties ``operation``
(``com.microsoft:renew-lock``, ...) and ``associated-link-name`` (its receive link, which ties the
request to that receiver's locks and session); the answer carries ``statusCode``,
``statusDescription`` and, on failure, ``errorCondition`` (the SDK maps the condition to its
exception class), with the request's message id as correlation id.

Implemented operations: renew-lock, update-disposition, receive-by-sequence-number, peek-message,
schedule-message, cancel-scheduled-message, renew-session-lock, get-session-state,
set-session-state. Anything else answers 501 ``amqp:not-implemented``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proton import Message, symbol

from . import wire
from .entities import Namespace
from .errors import BrokerError, InvalidArgument, NotAllowed
from .queues import Queue, Settlement
from .sections import EncodedMessage
from .send_target import SendTarget

_LOGGER = logging.getLogger(__name__)

# The SDK's disposition-status words (``MESSAGE_MGMT_SETTLEMENT_TERM_MAP``), spelling included.
_DISPOSITION_STATUS = {
    "completed": Settlement.COMPLETE,
    "abandoned": Settlement.ABANDON,
    "defered": Settlement.DEFER,
    "suspended": Settlement.DEAD_LETTER,
}
# AMQP receiver-settle-mode "first" (0) is the SDK's RECEIVE_AND_DELETE.
_RECEIVE_AND_DELETE = 0


@dataclass
class Request:
    """One management request: the entity it targets, who asked and when (seconds since the epoch)."""

    namespace: Namespace
    entity_path: str
    body: dict[str, Any]
    receiver: object | None  # the receive link named by associated-link-name, if still open
    now: float

    def queue(self) -> Queue:
        entity = self.namespace.entity(self.entity_path)
        if not isinstance(entity, Queue):
            raise NotAllowed(f"{self.entity_path} is not a queue or subscription")
        return entity

    def send_target(self) -> SendTarget:
        return self.namespace.send_target(self.entity_path)

    def session_id(self) -> str | None:
        return wire.as_text(self.body.get("session-id"))


_Operation = Callable[[Request], "tuple[int, dict[str, Any] | None]"]


def _renew_lock(request: Request) -> tuple[int, dict[str, Any] | None]:
    queue = request.queue()
    tokens = wire.as_list(request.body.get("lock-tokens"))
    expirations = [queue.renew_lock(token, request.now) for token in tokens]
    return 200, {"expirations": wire.timestamp_array(expirations)}


def _update_disposition(request: Request) -> tuple[int, dict[str, Any] | None]:
    queue = request.queue()
    status = wire.as_text(request.body.get("disposition-status")) or ""
    outcome = _DISPOSITION_STATUS.get(status)
    if outcome is None:
        raise InvalidArgument(f"unknown disposition-status {status!r}")
    for token in wire.as_list(request.body.get("lock-tokens")):
        queue.settle(
            token,
            outcome,
            request.now,
            reason=wire.as_text(request.body.get("deadletter-reason")),
            description=wire.as_text(request.body.get("deadletter-description")),
        )
    return 200, {}


def _receive_by_sequence_number(request: Request) -> tuple[int, dict[str, Any] | None]:
    queue = request.queue()
    session_id = request.session_id()
    owner = request.receiver
    if queue.requires_session:
        if session_id is None:
            raise InvalidArgument("session-id is required on a session entity")
        owner = queue.session_for(session_id, request.receiver, request.now).owner
    remove = request.body.get("receiver-settle-mode") == _RECEIVE_AND_DELETE
    numbers = [int(n) for n in wire.as_list(request.body.get("sequence-numbers"))]
    found = queue.lock_deferred(numbers, owner or request, request.now, session_id=session_id, remove=remove)
    messages = [{"lock-token": m.lock_token, "message": m.render()} for m in found]
    if remove:
        for m in messages:
            m.pop("lock-token")
    return 200, {"messages": messages}


def _peek(request: Request) -> tuple[int, dict[str, Any] | None]:
    queue = request.queue()
    start = int(request.body.get("from-sequence-number") or 1)
    count = int(request.body.get("message-count") or 1)
    found = queue.peek(start, count, request.session_id())
    if not found:
        return 204, None  # Service Bus's "no messages"; the SDK returns []
    return 200, {"messages": [{"message": m.render(with_lock_token=False)} for m in found]}


def _schedule(request: Request) -> tuple[int, dict[str, Any] | None]:
    target = request.send_target()
    numbers = []
    for entry in wire.as_list(request.body.get("messages")):
        content = EncodedMessage.decode(bytes(entry["message"]))
        when = content.annotations.get(wire.SCHEDULED_ENQUEUE_TIME)
        if when is None:
            raise InvalidArgument("a scheduled message needs x-opt-scheduled-enqueue-time")
        numbers.append(target.schedule(content, int(when) / 1000, request.now))
    return 200, {"sequence-numbers": wire.long_array(numbers)}


def _cancel_scheduled(request: Request) -> tuple[int, dict[str, Any] | None]:
    target = request.send_target()
    for number in wire.as_list(request.body.get("sequence-numbers")):
        target.cancel_scheduled(int(number))
    return 200, {}


def _required_session_id(request: Request) -> str:
    session_id = request.session_id()
    if session_id is None:
        raise InvalidArgument("session-id is required")
    return session_id


def _renew_session_lock(request: Request) -> tuple[int, dict[str, Any] | None]:
    until = request.queue().renew_session_lock(_required_session_id(request), request.receiver, request.now)
    return 200, {"expiration": wire.amqp_timestamp(until)}


def _get_session_state(request: Request) -> tuple[int, dict[str, Any] | None]:
    session = request.queue().session_for(_required_session_id(request), request.receiver, request.now)
    return 200, {"session-state": session.state}


def _set_session_state(request: Request) -> tuple[int, dict[str, Any] | None]:
    session = request.queue().session_for(_required_session_id(request), request.receiver, request.now)
    state = request.body.get("session-state")
    session.state = None if state is None else bytes(state)
    return 200, {}


OPERATIONS: dict[str, _Operation] = {
    f"{wire.VENDOR}:renew-lock": _renew_lock,
    f"{wire.VENDOR}:update-disposition": _update_disposition,
    f"{wire.VENDOR}:receive-by-sequence-number": _receive_by_sequence_number,
    f"{wire.VENDOR}:peek-message": _peek,
    f"{wire.VENDOR}:schedule-message": _schedule,
    f"{wire.VENDOR}:cancel-scheduled-message": _cancel_scheduled,
    f"{wire.VENDOR}:renew-session-lock": _renew_session_lock,
    f"{wire.VENDOR}:get-session-state": _get_session_state,
    f"{wire.VENDOR}:set-session-state": _set_session_state,
}


def answer(request_message: Message, request: Request) -> Message:
    """Run one management request and build its response (never raises for broker errors)."""
    operation = wire.as_text((request_message.properties or {}).get("operation")) or ""
    handler = OPERATIONS.get(operation)
    if handler is None:
        _LOGGER.info("$management: unsupported operation %s on %s", operation, request.entity_path)
        return _response(request_message, 501, f"{operation} is not implemented", None, wire.NOT_IMPLEMENTED)
    try:
        status, body = handler(request)
    except BrokerError as error:
        _LOGGER.info("$management: %s on %s failed: %s", operation, request.entity_path, error)
        return _response(request_message, error.status_code, str(error), None, error.condition)
    return _response(request_message, status, "OK" if status == 200 else "No Content", body, None)


def _response(
    request_message: Message,
    status: int,
    description: str,
    body: dict[str, Any] | None,
    condition: str | None,
) -> Message:
    properties: dict[str, Any] = {"statusCode": status, "statusDescription": description}
    if condition is not None:
        properties["errorCondition"] = symbol(condition)
    return Message(correlation_id=request_message.id, properties=properties, body=body)
