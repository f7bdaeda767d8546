"""The handler's side of one delivery: :class:`Context`, what ``handle()`` gets besides its message
(the transaction's connection, downstream idempotency keys, evidence, outbox publishing)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from psycopg import AsyncConnection
from pydantic import BaseModel

from consumer_kit.codec.envelope import Envelope
from consumer_kit.effects import LeaseHooks
from consumer_kit.errors import ConfigurationError, ContextSealed
from consumer_kit.identity import downstream_key
from consumer_kit.model.events import PendingEvent
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.outbox import operation_event


class Context:
    """What a handler gets besides its message.

    Attributes:
        operation: scope, key and fingerprint of the operation.
        envelope: broker facts of the delivery (message id, headers, delivery count).
        events: the outbox events published so far (written with the ledger's completion).
        sealed: ``True`` once ``handle()`` returned: nothing can be added any more.
    """

    def __init__(
        self,
        connection: AsyncConnection[Any] | None,
        operation: OperationIdentity,
        envelope: Envelope,
        *,
        lease: LeaseHooks | None = None,
    ) -> None:
        self._connection = connection
        self.operation = operation
        self.envelope = envelope
        self._lease = lease
        self.events: list[PendingEvent] = []
        self.sealed = False

    @property
    def connection(self) -> AsyncConnection[Any]:
        """The psycopg connection inside the delivery's transaction: everything written through
        it commits together with the ledger row and the outbox rows.

        Raises:
            ConfigurationError: a handler with ``external_effects`` has not called
                ``await ctx.begin()`` yet (its writes belong to the completion transaction, which
                opens after its remote calls).
        """
        if self._connection is None:
            raise ConfigurationError(
                "this handler has external_effects: call `conn = await ctx.begin()` after the remote "
                "calls; its writes commit with the ledger's completion"
            )
        return self._connection

    async def begin(self) -> AsyncConnection[Any]:
        """The connection of the transaction that commits with the ledger's completion: the open
        delivery transaction on the transactional path; on the leased path (``external_effects``)
        it is opened here, once, so no database transaction is held during remote calls."""
        if self._connection is None and self._lease is not None:
            self._connection = await self._lease.begin()
        return self.connection

    def downstream_key(self, name: str) -> str:
        """An idempotency key for the remote call ``name`` (a UUID string), derived from scope,
        operation key and ``name``: identical on every attempt and every worker, so the remote
        side (payment API, e-mail provider) can deduplicate retries of this operation's call."""
        return downstream_key(self.operation.scope, self.operation.key, name)

    async def record_evidence(self, name: str, **facts: Any) -> None:
        """Durably record ``facts`` (JSON values; no secrets) about the remote call ``name``, in a
        short transaction of its own: the intent before the call (``intent=...``) and what came
        back after (remote request id, provider message id, status). A worker that recovers the
        operation reads them in ``Handler.reconcile``; ``consumer-kit ledger show`` prints them.

        Raises:
            ConfigurationError: the handler does not declare ``external_effects``.
            ContextSealed: ``handle()`` has already returned.
            LeaseLost: this worker no longer holds the operation (another took it over): stop.
        """
        if self._lease is None:
            raise ConfigurationError(
                "record_evidence needs `external_effects = True` on the handler (the leased path)"
            )
        if self.sealed:
            raise ContextSealed(f"record_evidence({name!r}) after handle() returned")
        await self._lease.record_evidence(name, facts)

    def seal(self) -> None:
        """Called by the runtime when ``handle()`` returned: the delivery's transaction is being
        completed, so nothing can be added to it any more."""
        self.sealed = True

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
        """Add ``event`` to the outbox in this transaction; the relay publishes it after COMMIT.

        The rows are written with the ledger's completion, in the same transaction and in publish
        order (one statement for all of them and the completion); if the handler fails, none is.

        Args:
            event: a pydantic model, serialised in JSON mode.
            destination: outbox destination (by default a RabbitMQ topic exchange of that name).
            routing_key: routing key within the destination.
            partition_key: ordering key: events with the same key are published in commit order.
            headers: extra string headers.
            message_type: defaults to the model's class name.

        Returns:
            The event ID (UUID): the broker message id on every publish attempt.

        Raises:
            ValueError: empty destination, or headers over the outbox's limit.
            ContextSealed: ``handle()`` has already returned (e.g. a background task publishing
                late): the event could not be written with the delivery's transaction.
        """
        if self.sealed:
            raise ContextSealed(
                f"ctx.publish({type(event).__name__}) after handle() returned for operation "
                f"{self.operation.scope}/{self.operation.key}: the delivery's transaction is over, "
                "so the event would be lost; await every publish inside handle()"
            )
        pending = operation_event(self.operation, len(self.events), event, destination=destination,
                                  routing_key=routing_key, partition_key=partition_key, headers=headers or {},
                                  message_type=message_type)
        self.events.append(pending)
        return pending.event_id

    @property
    def published(self) -> list[uuid.UUID]:
        """Event IDs published so far in this delivery."""
        return [e.event_id for e in self.events]
