"""Every error consumer-kit's core raises or asks handlers to raise, in one place (an adapter's own
errors are in its package's ``errors`` module; docs/explanation/architecture.md, "Errors")."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class ConsumerKitError(Exception):
    """Base class of consumer-kit's own errors."""


class ConfigurationError(ConsumerKitError):
    """Settings, handler declarations or broker topology are wrong; raised at start-up."""


class RetryableError(ConsumerKitError):
    """Raise from a handler for a transient failure: the transaction rolls back and the delivery
    is retried with backoff; after ``max_deliveries`` it is dead-lettered with the error class in the
    reason. Any exception that is not a :class:`PermanentFailure` is treated the same way."""


class PermanentFailure(ConsumerKitError):
    """Raise from a handler for a business failure that retrying cannot fix (e.g. "customer closed").

    The handler's writes roll back; a retained ``failed`` ledger row records ``code`` and ``detail``;
    the delivery is acked; every later duplicate replays this failure without running the handler.

    Args:
        code: short machine-readable code, stored as the result status (<= 200 characters).
        detail: human-readable explanation without payload content (<= 2,000 characters).
    """

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(f"{code}: {detail}" if detail else code)
        self.code = code[:200]
        self.detail = detail[:2000]


class ContextSealed(ConsumerKitError):
    """``ctx.publish`` after ``handle()`` returned (a background task, a callback): the delivery's
    transaction is over, so the event cannot be written with it."""


class LeaseLost(ConsumerKitError):
    """This worker no longer holds the operation's lease (another worker took it over after it
    expired): whatever this attempt does now is fenced out; it must stop, and its delivery is not
    acked."""


class InvalidMessage(ConsumerKitError):
    """A delivery cannot be processed as sent; it is dead-lettered with ``reason``."""

    def __init__(self, reason: DeadLetterReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class SimulatedCrash(BaseException):
    """Raised by an armed crash point (see :mod:`consumer_kit.pipeline.crashpoints`).

    A ``BaseException`` so that handler code catching ``Exception`` cannot swallow it. The runtime
    treats it like process death: the delivery is left unsettled and the broker redelivers it.
    """


class DeadLetterReason(enum.StrEnum):
    """Machine-readable dead-letter reasons (header ``x-dead-letter-reason``)."""

    INVALID_JSON = "invalid_json"  # not RFC 8259 JSON in UTF-8, or without one meaning
    INVALID_NUMBER = "invalid_number"  # a number the runtime cannot hold or compare by value
    SCHEMA_MISMATCH = "schema_mismatch"
    MISSING_OPERATION_KEY = "missing_operation_key"
    INVALID_OPERATION_KEY = "invalid_operation_key"
    INVALID_HEADER = "invalid_header"
    UNKNOWN_MESSAGE_TYPE = "unknown_message_type"
    PAYLOAD_CONFLICT = "payload_conflict"
    INVALID_DATA = "invalid_data"  # PostgreSQL cannot store a value (NUL in text, out of range)
    MAX_DELIVERIES = "max_deliveries_exceeded"
    MAX_CONTENTIONS = "max_contentions_exceeded"
    CRASHED_WORKER = "crashed_worker"  # the process died crash_limit times while it ran alone
    KEY_EXPIRED = "key_expired"  # older than its key retention, and its identity is gone
    NEEDS_RECONCILIATION = "needs_reconciliation"


class StatementTimeout(Exception):
    """A statement of consumer-kit's own (claim, completion, COMMIT, attempt bookkeeping) did not
    answer within ``statement_timeout`` seconds: the database or the network is at fault. Its
    connection is discarded."""


# -- optional parts: the pip extra that brings each SDK --------------------------------------------
#
# An adapter package declares its extra in the first lines of its ``__init__``, before it imports
# its SDK (``except ImportError as missing: raise MissingExtra("sqs", missing) from missing``), so
# that :func:`consumer_kit.broker.registry.adapter_for` can say which extra to install without a table
# of its own (the core never imports an adapter by name, nor any SDK).


def install_hint(extra: str) -> str:
    """The commands that install ``extra``: ``pip install 'consumer-kit[sqs]' (from a clone: pip
    install -e '.[sqs]')``. consumer-kit is not on PyPI: the first adds the extra's packages to the
    consumer-kit already installed (pip keeps that one), the second installs from a clone's root."""
    return f"pip install 'consumer-kit[{extra}]' (from a clone: pip install -e '.[{extra}]')"


class MissingExtra(ImportError):
    """An optional part's SDK is not installed.

    Args:
        extra: the pip extra that brings it (a ``[project.optional-dependencies]`` key).
        missing: the ImportError of the SDK.

    Attributes:
        extra, missing: as given; ``hint``: :func:`install_hint` of ``extra``.
    """

    def __init__(self, extra: str, missing: ImportError) -> None:
        super().__init__(f"{missing} ({install_hint(extra)})", name=missing.name, path=missing.path)
        self.extra, self.missing = extra, missing
        self.hint = install_hint(extra)


# -- operation identity ------------------------------------------------------------------------------



class UnsupportedNumber(ValueError):
    """A number the fingerprint cannot compare by value: NaN or an infinity (NaN is not even
    equal to itself), or beyond :data:`MAX_NUMBER_DIGITS`."""


# -- optimistic versions -----------------------------------------------------------------------------



class StaleVersion(ConsumerKitError):
    """A versioned write found the row at another version than expected.

    Attributes:
        table: the table written.
        key: the row's key columns and values.
        expected: the version the write expected (:func:`update_expecting`).
        found: the version stored.
    """

    def __init__(self, table: str, key: Mapping[str, Any], expected: int, found: int) -> None:
        super().__init__(
            f"{table} row {', '.join(f'{k}={v!r}' for k, v in key.items())} is at version {found}, "
            f"not {expected}: a stale update"
        )
        self.table, self.key, self.expected, self.found = table, dict(key), expected, found


# -- publishing (the relay's side of the broker contract) --------------------------------------------



class PublishError(Exception):
    """The broker did not confirm a publish (nack, return, timeout, lost connection, refusal).

    Three kinds, which the relay treats differently:

    * transient (``transient=True``, the default): the broker or the connection is at fault and
      the same message will go through once it is back (connection lost, timeout, nack). Retried
      soon; never parks a row.
    * row (``transient=False``): this message could not be delivered as addressed but might be
      later (no such queue yet). Backed off; parked after the relay's max attempts.
    * permanent (``permanent=True``): this message can never be published as it is (too large for
      the broker's frame or message limit, a destination of another type, access refused). Parked
      at once, with the broker's reply text in ``str(error)``.
    """

    def __init__(self, message: str, *, transient: bool = True, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.transient = transient and not permanent


class PublishTimeout(PublishError):
    """No confirm within the time :meth:`Publisher.publish_batch` was given (transient: the
    broker may still have the message; publishing again with the same ``message_id`` is safe)."""

    def __init__(self, message: str = "not confirmed in time") -> None:
        super().__init__(message, transient=True)


class LockLost(ConsumerKitError):
    """The broker no longer holds this delivery's peek-lock for this worker (its lock, visibility
    timeout or ``ack_wait`` lapsed, or the broker reported it lost): a settlement was not applied,
    and the message comes, or came, back by itself. Raised by an adapter's settlement; the runtime
    reports the delivery ``lost`` and the redelivery is answered by the ledger."""


# -- dead-letter queues ------------------------------------------------------------------------------



class CopyRefused(Exception):
    """Raised by :meth:`Redrive.send_copy`: the broker refused this copy, or it does not fit; the
    text says why (no payload). The dead letter is counted ``failed`` and left where it is."""


class RemoveFailed(Exception):
    """Raised by :meth:`Redrive.remove`: the copy was sent but the dead letter could not be removed;
    the text says why. It stays in the dead-letter queue too (a second redrive is a duplicate)."""


# -- the delivery pipeline ---------------------------------------------------------------------------



class GiveBack(Exception):
    """The delivery must not start now (``reason`` is ``"paused"``): release it uncounted."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class HandlerTimeout(RetryableError):
    """The handler ran longer than ``handler_timeout``: a handler fault (rolled back, retried)."""


class TransactionEnded(Exception):
    """The handler ended the delivery's transaction itself (``COMMIT``/``ROLLBACK`` sent as SQL,
    possibly followed by a new ``BEGIN``): part of its effect may be durable without the
    ledger's completion."""


class CommitUncertain(Exception):
    """The COMMIT was sent but its reply was lost or late: the effect may or may not be durable.
    The connection has been discarded."""


class StaleConnection(Exception):
    """A pooled connection was dead before anything was sent on it: take another one."""


# -- the HTTP front door -----------------------------------------------------------------------------



class KeyRefused(Exception):
    """The request's ``Idempotency-Key`` cannot be used; ``detail`` says why (never quoting it)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class MissingKey(KeyRefused):
    """No ``Idempotency-Key`` field on a route that requires one (draft section 2.7: 400)."""


class MalformedKey(KeyRefused):
    """The field is present but is not one sf-string in the published :class:`KeyFormat`."""


class InvalidBody(Exception):
    """The request body has no single meaning to fingerprint; ``detail`` names the rule."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class BodyTooLarge(Exception):
    """The request body is over the limit; ``detail`` (no body content) says by what measure."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ResponseNotStorable(Exception):
    """The endpoint's response cannot be stored for replay; ``detail`` says why (no body)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


# -- operator actions --------------------------------------------------------------------------------



class Refused(Exception):
    """The action was refused; the text says why and what to do instead (no payload)."""
