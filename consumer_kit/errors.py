"""Every error consumer-kit raises or asks handlers to raise, in one place."""

from __future__ import annotations

import enum


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
