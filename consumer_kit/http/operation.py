"""What an idempotent endpoint works with: its transaction, its operation identity, its events.

An endpoint gets the :class:`Operation` of the request it serves from :func:`current_operation`
(FastAPI: ``op: Operation = Depends(current_operation)``). Everything written through
``op.connection`` and every event added with ``op.publish`` commits in one transaction with the
ledger's completion and the stored response, or not at all.

Events carry the operation's identity downstream (docs/how-to/http.md): the outbox
row's ``operation_scope``/``operation_key`` columns (the relay's ``operation-scope`` and
``operation-key`` headers), and the headers ``operation-id`` = the idempotency key and
``tenant-id`` = the client, which a consumer-kit worker reads as its own operation key and tenant.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import Mapping
from typing import Any

from psycopg import AsyncConnection
from pydantic import BaseModel

from consumer_kit.codec.envelope import OPERATION_ID_HEADER, TENANT_HEADER
from consumer_kit.errors import ConfigurationError, ContextSealed
from consumer_kit.model.events import PendingEvent
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.outbox import operation_event

_CURRENT: contextvars.ContextVar[Operation | None] = contextvars.ContextVar(
    "consumer_kit_http_operation", default=None
)


class Operation:
    """The idempotent request being served.

    Attributes:
        identity: scope (client + method + route + API version), key (the ``Idempotency-Key``)
            and fingerprint of the request.
        client: the authenticated client (or tenant) the scope belongs to.
        events: the outbox events published so far (written with the completion).
    """

    def __init__(self, connection: AsyncConnection[Any], identity: OperationIdentity, client: str) -> None:
        self._connection = connection
        self.identity = identity
        self.client = client
        self.events: list[PendingEvent] = []
        self.sealed = False

    @property
    def key(self) -> str:
        """The idempotency key: the operation key in the ledger and downstream."""
        return self.identity.key

    @property
    def connection(self) -> AsyncConnection[Any]:
        """The connection inside the request's transaction: what is written through it commits
        with the ledger's completion and the stored response.

        Raises:
            ContextSealed: the endpoint has returned (a background task using it late).
        """
        if self.sealed:
            raise ContextSealed(f"operation {self.identity.scope}: its transaction is over")
        return self._connection

    async def publish(
        self,
        event: BaseModel,
        *,
        destination: str,
        routing_key: str = "",
        partition_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        message_type: str | None = None,
    ) -> uuid.UUID:
        """Add ``event`` to the outbox with this request's transaction; the relay publishes it
        after COMMIT (with ``destination``, ``routing_key`` and ``partition_key`` as in
        :meth:`consumer_kit.Context.publish`). Its headers are ``headers`` plus ``operation-id``
        (the idempotency key) and ``tenant-id`` (the client).

        Returns:
            The event ID (UUID): the broker message id on every publish attempt.

        Raises:
            ValueError: ``headers`` set ``operation-id`` or ``tenant-id`` to something else, an
                empty destination, or headers over the outbox's limit.
            ContextSealed: the endpoint has already returned.
        """
        if self.sealed:
            raise ContextSealed(
                f"publish({type(event).__name__}) after the endpoint returned for operation "
                f"{self.identity.scope}: its transaction is over, so the event would be lost"
            )
        carried = {OPERATION_ID_HEADER: self.identity.key, TENANT_HEADER: self.client}
        for name, value in carried.items():
            if name in (headers or {}) and (headers or {})[name] != value:
                raise ValueError(f"header {name!r} of an event of an idempotent request is set by consumer_kit.http")
        pending = operation_event(self.identity, len(self.events), event, destination=destination,
                                  routing_key=routing_key, partition_key=partition_key,
                                  headers={**(headers or {}), **carried}, message_type=message_type)
        self.events.append(pending)
        return pending.event_id

    def seal(self) -> None:
        """Called when the endpoint returned: nothing can be added to its transaction any more."""
        self.sealed = True


def current_operation() -> Operation:
    """The :class:`Operation` of the idempotent request being served (a FastAPI dependency too:
    ``op: Operation = Depends(current_operation)``).

    Raises:
        ConfigurationError: called outside an idempotent endpoint (FastAPI: the route's class is
            not ``IdempotentRoute``, or the endpoint lacks ``@idempotency.endpoint()``).
    """
    operation = _CURRENT.get()
    if operation is None:
        raise ConfigurationError(
            "no idempotent request is being served here: decorate the endpoint with "
            "@idempotency.endpoint() and, on FastAPI, create its router with route_class=IdempotentRoute"
        )
    return operation


def serving(operation: Operation | None) -> contextvars.Token[Operation | None]:
    """Make ``operation`` the current one; returns the token that :func:`stop_serving` takes."""
    return _CURRENT.set(operation)


def stop_serving(token: contextvars.Token[Operation | None]) -> None:
    """Undo :func:`serving`."""
    _CURRENT.reset(token)


def is_serving() -> bool:
    """``True`` inside an idempotent request's endpoint."""
    return _CURRENT.get() is not None
