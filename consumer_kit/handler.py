"""The handler API: subclass :class:`Handler` and implement :meth:`Handler.handle`.

Example::

    class CreateInvoiceHandler(Handler[CreateInvoice]):
        operation_type = "invoice.create"
        fingerprint_exclude = {"requested_at"}

        def operation_key(self, message: CreateInvoice, envelope: Envelope) -> str:
            return f"order-{message.order_id}-rev-{message.revision}"

        async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
            await ctx.connection.execute("INSERT INTO invoices ...", (...))
            await ctx.publish(InvoiceCreated(...), destination="billing.events",
                              routing_key="invoice.created", partition_key=str(message.order_id))
            return Result(status="created", reference=str(invoice_id))
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import typing
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from psycopg import AsyncConnection
from pydantic import BaseModel

from consumer_kit.codec.envelope import DEFAULT_TENANT, PARTITION_KEY_HEADER, TENANT_HEADER, Envelope
from consumer_kit.effects import Evidence, LeaseHooks, Reconciled
from consumer_kit.errors import ConfigurationError, ContextSealed, DeadLetterReason, InvalidMessage
from consumer_kit.identity import check_scope_parts, downstream_key, fingerprint_of
from consumer_kit.model.events import PendingEvent
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.results import Result
from consumer_kit.model.retention import Retention
from consumer_kit.outbox import event_id_for, pending_event
from consumer_kit.tenancy import check_tenant_senders, refuse_tenant

M = TypeVar("M", bound=BaseModel)


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
        pending = pending_event(
            destination=destination,
            routing_key=routing_key,
            message_type=message_type or type(event).__name__,
            payload=event.model_dump(mode="json"),
            partition_key=partition_key,
            headers=headers or {},
            event_id=event_id_for(self.operation.scope, self.operation.key, self.operation.fingerprint, len(self.events)),
        )
        self.events.append(pending)
        return pending.event_id

    @property
    def published(self) -> list[uuid.UUID]:
        """Event IDs published so far in this delivery."""
        return [e.event_id for e in self.events]


MAX_BATCH_SIZE = 1000
"""The largest ``batch_size``: the batch's arrays travel as statement parameters."""


def batches_at_once(handler: Handler[Any]) -> bool:
    """The handler overrides :meth:`Handler.handle_batch` (one call for a batch's new items)."""
    return type(handler).handle_batch is not Handler.handle_batch


def check_batch(cls: type[Handler[Any]]) -> None:
    """Refuse a batch setting the batch path cannot keep (docs/how-to/batches.md).

    Raises:
        ConfigurationError: ``batch_size`` not an int in 1..:data:`MAX_BATCH_SIZE`, ``batch_wait``
            negative or not a number, or ``batch_size > 1`` with ``external_effects``.
    """
    size, wait = cls.batch_size, cls.batch_wait
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_BATCH_SIZE:
        raise ConfigurationError(f"{cls.__name__}.batch_size must be an int from 1 to {MAX_BATCH_SIZE}, not {size!r}")
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 60:
        raise ConfigurationError(f"{cls.__name__}.batch_wait must be seconds from 0 to 60, not {wait!r}")
    if size > 1 and cls.external_effects:
        raise ConfigurationError(
            f"{cls.__name__} has external_effects and batch_size {size}: a handler with external "
            "effects commits its claim under a lease and finishes in a transaction of its own, so "
            "its deliveries cannot share one; set batch_size = 1"
        )


class Handler(Generic[M]):
    """Base class of message handlers, generic in the pydantic message model.

    Attributes:
        operation_type: what the operation does, e.g. ``"invoice.create"`` (required).
        fingerprint_exclude: fields left out of the fingerprint (volatile: timestamps, trace ids),
            in pydantic's ``exclude`` syntax (a set of names or a nested mapping).
        version: part of the scope; bump it when the meaning of keys changes.
        projection_version: bump when the intent projection changes (stored with the fingerprint).
        earlier_projections: ``{version: fingerprint_exclude of that version}`` for every earlier
            ``projection_version`` whose operations may still be redelivered or replayed: a message
            whose operation was recorded under an earlier version is compared under that version
            (same intent: duplicate; another: payload conflict). Without it the intents cannot be
            compared, and such a message is dead-lettered as ``needs_reconciliation``, never acked
            as a duplicate. Override :meth:`projection` for changes an exclude set cannot say.
        message_type: name matched against header ``message-type`` when several handlers share a
            queue; defaults to the model's class name.
        key_from_message_id: fall back to the broker message id when no ``operation-id`` header is
            present (only safe where producers set a stable message id per operation).
        result_retention: how long the stored result body is kept (``datetime.timedelta``;
            ``None``: until the identity goes); ``consumer-kit prune`` deletes it after.
        key_retention: how long the operation's identity (scope, key, fingerprint, outcome) is
            kept (``None``, the default: for ever). A message older than this that finds no
            identity row is refused as ``key_expired``, never executed as new (see
            docs/explanation/retention.md). Its age is header ``operation-created-at`` (ISO 8601) or the broker's
            enqueue time.
        tenant_senders: ``None`` (the default: the tenant is believed as :meth:`tenant` returns it,
            i.e. whatever the producer wrote in ``tenant-id``), or the allow-list
            ``{authenticated sender: tenants it may act for}`` (``"*"``: any tenant, for
            consumer-kit's own identities whose copies a broker attributes to them, e.g. the
            worker's IAM principal on SQS). A delivery whose tenant is not listed for its
            ``envelope.sender`` (or that has no sender) is dead-lettered at once as
            ``invalid_header`` naming ``tenant-id``, before any claim: never executed, and the
            genuine tenant's key stays free. See docs/explanation/trust.md for each broker's sender.
        permanent: the effects are irreversible (money, entitlements): the identity is never
            deleted, whatever ``key_retention`` says elsewhere (setting both is refused).
        external_effects: the handler calls something outside PostgreSQL (a payment API, e-mail):
            take the leased path (see :mod:`consumer_kit.effects`): the claim commits first under
            a lease, ``ctx.record_evidence`` and ``ctx.downstream_key`` serve the remote calls,
            ``await ctx.begin()`` opens the completion transaction, and ``reconcile`` decides for
            an operation whose previous owner died.
        batch_size: up to how many deliveries of this handler's queue run in one transaction
            (the batch path, docs/how-to/batches.md): ``1`` (the default) runs each delivery in a
            transaction of its own. A batch claims all its keys in one statement, runs ``handle``
            for the new ones one after the other on one connection, completes them in one
            statement and commits once; each delivery keeps its own outcome. Not with
            ``external_effects`` (each of those needs a lease and a transaction of its own).
        batch_wait: seconds a batch waits for more deliveries once its first one arrived, when
            fewer than ``batch_size`` are at hand (``0``: take what has arrived together).
    """

    operation_type: ClassVar[str]
    fingerprint_exclude: ClassVar[Any] = None
    version: ClassVar[int] = 1
    projection_version: ClassVar[int] = 1
    earlier_projections: ClassVar[Mapping[int, Any]] = {}
    message_type: ClassVar[str | None] = None
    key_from_message_id: ClassVar[bool] = False
    external_effects: ClassVar[bool] = False
    batch_size: ClassVar[int] = 1
    batch_wait: ClassVar[float] = 0.0
    result_retention: ClassVar[dt.timedelta | None] = dt.timedelta(days=30)
    key_retention: ClassVar[dt.timedelta | None] = None
    permanent: ClassVar[bool] = False
    tenant_senders: ClassVar[Mapping[str, Collection[str]] | None] = None
    model: ClassVar[type[BaseModel]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is Handler:
                (arg,) = typing.get_args(base)
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    cls.model = arg
        if cls.message_type is None and hasattr(cls, "model"):
            cls.message_type = cls.model.__name__

    def __init__(self) -> None:
        operation_type = getattr(type(self), "operation_type", None)
        if not operation_type:
            raise ConfigurationError(f"{type(self).__name__} must set operation_type")
        if "/" in operation_type or not operation_type.isprintable():
            # the scope "<tenant>/<operation_type>/v<n>" must read one way only
            raise ConfigurationError(
                f"{type(self).__name__}.operation_type={operation_type!r}: no '/' and no control "
                "characters (e.g. 'invoice.create')"
            )
        check_scope_parts(operation_type, type(self).version, owner=type(self).__name__)
        if not hasattr(type(self), "model"):
            raise ConfigurationError(
                f"{type(self).__name__} must subclass Handler[YourModel] with a pydantic model"
            )
        if not inspect.iscoroutinefunction(type(self).handle):
            raise ConfigurationError(f"{type(self).__name__}.handle must be `async def`")
        cls = type(self)
        if cls.permanent and cls.key_retention is not None:
            raise ConfigurationError(
                f"{cls.__name__} is permanent: its identity is never deleted, so it takes no key_retention"
            )
        for name in ("result_retention", "key_retention"):
            value = getattr(cls, name)
            if value is not None and (not isinstance(value, dt.timedelta) or value <= dt.timedelta(0)):
                raise ConfigurationError(f"{cls.__name__}.{name} must be a positive datetime.timedelta or None")
        check_tenant_senders(cls.tenant_senders, owner=cls.__name__)
        check_batch(cls)
        stale = [v for v in type(self).earlier_projections if v >= type(self).projection_version]
        if stale:
            raise ConfigurationError(
                f"{type(self).__name__}.earlier_projections names versions {stale}, not below "
                f"projection_version {type(self).projection_version}"
            )

    @functools.cached_property  # read on every delivery; the class attributes it reads are fixed
    def retention(self) -> Retention:
        """The ledger retention of this handler's operations (seconds; ``None``: kept)."""
        cls = type(self)
        return Retention(
            body_seconds=cls.result_retention.total_seconds() if cls.result_retention else None,
            key_seconds=cls.key_retention.total_seconds() if cls.key_retention and not cls.permanent else None,
        )

    def partition_key(self, message: M, envelope: Envelope) -> str | None:
        """The ordering key: deliveries with the same key run one at a time, in delivery order
        (``None``: no order). Default: the broker's own (SQS message group, Service Bus session),
        else header ``partition-key``. Override it to order by an aggregate of the message."""
        if envelope.partition_key:
            return envelope.partition_key
        value = envelope.header(PARTITION_KEY_HEADER)
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        return value if isinstance(value, str) and value else None

    def projection(self, message: M, version: int) -> Any:
        """The intent projection of ``message`` under projection ``version``: what its fingerprint
        covers (by default the message without that version's ``fingerprint_exclude``), or
        ``None`` when this handler does not know that version.

        Override it for projection changes an exclude set cannot express (a renamed field, a unit
        change); keep every version that recorded operations you may still receive.
        """
        if version == type(self).projection_version:
            exclude = type(self).fingerprint_exclude
        elif version in type(self).earlier_projections:
            exclude = type(self).earlier_projections[version]
        else:
            return None
        return message.model_dump(mode="python", exclude=exclude)

    def fingerprint_under(self, message: M, version: int) -> str | None:
        """SHA-256 (hex) of ``message``'s projection under ``version``, or ``None`` when this
        handler does not know that version.

        Raises:
            UnsupportedNumber: the projection holds NaN, an infinity or an extreme number.
        """
        projected = self.projection(message, version)
        return None if projected is None else fingerprint_of(projected)

    def operation_key(self, message: M, envelope: Envelope) -> str | None:
        """The stable operation key. Default: header ``operation-id``, else (opt-in) the broker
        message id, else ``None`` (dead-lettered as ``missing_operation_key``)."""
        key = envelope.operation_id
        if key in (None, "") and self.key_from_message_id:
            key = envelope.message_id
        return typing.cast("str | None", key)

    def tenant(self, message: M, envelope: Envelope) -> str:
        """The tenant: header ``tenant-id``, default ``"default"``. Override it to derive the
        tenant from ``envelope.sender`` (the broker-authenticated producer) instead; either way,
        ``tenant_senders`` then checks the result against the sender.

        Raises:
            InvalidMessage: ``invalid_header`` when the header is not a string.
        """
        value = envelope.header(TENANT_HEADER)
        if value in (None, ""):
            return DEFAULT_TENANT
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8", errors="strict")
            except UnicodeDecodeError:
                raise InvalidMessage(DeadLetterReason.INVALID_HEADER, "tenant-id is not UTF-8") from None
        if not isinstance(value, str):
            raise InvalidMessage(DeadLetterReason.INVALID_HEADER, "tenant-id must be a string")
        return value

    def refuse_tenant(self, tenant: str, envelope: Envelope) -> None:
        """Apply ``tenant_senders`` (see :func:`consumer_kit.tenancy.refuse_tenant`).

        Raises:
            InvalidMessage: ``invalid_header`` naming ``tenant-id``: the sender may not act for it.
        """
        refuse_tenant(type(self).tenant_senders, tenant, envelope, owner=type(self).__name__)

    async def reconcile(self, message: M, evidence: Evidence, ctx: Context) -> Reconciled:
        """Decide, for an operation whose previous owner's lease expired, whether its remote
        effect happened (leased path only; called before anything else). Query the remote side
        with ``ctx.downstream_key(name)`` and the ``evidence`` facts.

        The default knows nothing about the remote side: ``unknown`` (park for an operator) when
        any call recorded evidence (it may have reached the remote side), else ``not_done``.
        """
        if evidence.started():
            return Reconciled.unknown(
                f"{type(self).__name__} recorded a remote call ({', '.join(sorted({r.name for r in evidence}))}) "
                "and has no reconcile()"
            )
        return Reconciled.not_done()

    async def handle(self, message: M, ctx: Context) -> Result | None:
        """Do the business effect through ``ctx.connection`` and ``ctx.publish``.

        Raises:
            PermanentFailure: a business failure; recorded and replayed to duplicates.
            RetryableError: (or any other exception) rolled back and retried.
        """
        raise NotImplementedError


    async def handle_batch(self, batch: Sequence[tuple[M, Context]]) -> Sequence[Result | None]:
        """Optional, for a handler with ``batch_size > 1``: do the effects of every new operation
        of a batch at once (for example one ``unnest`` statement per table instead of one
        statement per message), through the one connection they share (``ctx.connection`` of any
        item) and each item's own ``ctx.publish``. ``batch`` is ``(message, context)`` of each
        newly claimed operation, in delivery order; return one result per item, in that order.

        Not overridden (the default), the batch path calls :meth:`handle` for each item. When it
        raises, nothing of the batch is kept and its items run through :meth:`handle` one by one
        in the batch's transaction instead, so each meets its own fault (docs/how-to/batches.md);
        :meth:`handle` is also what a redelivered or retried item runs on its own, so both must
        have the same effect.

        Raises:
            Exception: any: the batch is run again item by item through :meth:`handle`.
        """
        raise NotImplementedError
