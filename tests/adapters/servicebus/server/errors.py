"""Failures the broker reports, each with the AMQP condition and management status Service Bus uses.

The same error travels two ways: as the condition of a ``rejected`` outcome or link detach, and
as ``statusCode``/``errorCondition`` application properties on a ``$management`` response. The
SDK turns the condition into its exception class (``MessageLockLostError``, ...).
"""

from __future__ import annotations

from . import wire


class BrokerError(Exception):
    """Base class: ``condition`` is the AMQP error symbol, ``status_code`` the management status."""

    condition = "amqp:internal-error"
    status_code = 500


class EntityNotFound(BrokerError):
    condition = wire.NOT_FOUND
    status_code = 404


class NotAllowed(BrokerError):
    """An operation the entity does not support (a plain receiver on a session queue, ...)."""

    condition = wire.NOT_ALLOWED
    status_code = 400


class InvalidArgument(BrokerError):
    condition = wire.ARGUMENT_ERROR
    status_code = 400


class MessageLockLost(BrokerError):
    """The lock token is unknown, already settled or expired."""

    condition = wire.MESSAGE_LOCK_LOST
    status_code = 410


class SessionLockLost(BrokerError):
    """The session lock expired or belongs to another receiver."""

    condition = wire.SESSION_LOCK_LOST
    status_code = 410


class SessionCannotBeLocked(BrokerError):
    """Another receiver holds the requested session."""

    condition = wire.SESSION_CANNOT_BE_LOCKED
    status_code = 410


class MessageNotFound(BrokerError):
    """No deferred (or scheduled) message with that sequence number."""

    condition = wire.MESSAGE_NOT_FOUND
    status_code = 404


class MessageTooLarge(BrokerError):
    condition = wire.MESSAGE_SIZE_EXCEEDED
    status_code = 413
