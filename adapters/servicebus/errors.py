"""What a Service Bus failure means: lock loss, connection trouble, and PublishError kinds.

Classification of a failed publish (``consumer_kit.broker.publishing.PublishError``):

==============================================================  ==========  ========================
cause (azure-servicebus exception)                              kind        why
==============================================================  ==========  ========================
too large for the entity's or the link's limit (checked before  permanent   the same bytes fail the
sending; ``MessageSizeExceededError``), a message the SDK                   same way every time
cannot build (``ValueError``/``TypeError``), refused as
addressed (``ServiceBusAuthorizationError``; ``ServiceBusError``
with ``amqp:not-allowed`` e.g. no session id for a session
queue) *when this message alone was sent*
no such queue or topic (``MessagingEntityNotFoundError``), the  row         the entity may appear or
entity is disabled (``MessagingEntityDisabledError``)                       be enabled later
connection, communication, authentication, timeout, server      transient   the broker or the network
busy (once sending again with backoff overran                               is at fault; retry soon
``confirm_timeout``, :mod:`.throttling`), quota exceeded,
anything else, and any refusal of a batch of several messages
(each is then sent alone, see the publisher)
==============================================================  ==========  ========================
"""

from __future__ import annotations

from azure.servicebus.exceptions import (
    MessageLockLostError,
    MessageSizeExceededError,
    MessagingEntityDisabledError,
    MessagingEntityNotFoundError,
    ServiceBusAuthorizationError,
    ServiceBusError,
    SessionLockLostError,
)

from consumer_kit.errors import ConfigurationError, PublishError

LOCK_LOST = (MessageLockLostError, SessionLockLostError)
"""The delivery is no longer ours: never settle it as done, let the broker redeliver it."""

ENTITY_MISSING = (MessagingEntityNotFoundError, MessagingEntityDisabledError)
"""The queue, topic or subscription does not exist (or is disabled): retrying will not help soon."""

_NOT_ALLOWED = "amqp:not-allowed"


def describe(exc: BaseException | None) -> str:
    """``"ErrorClass: first line"`` of an exception, for one-line logs and errors (the SDK's
    messages name entities and conditions, never message bodies)."""
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def is_refusal(exc: BaseException) -> bool:
    """True when Service Bus refused the message as addressed: what publishing alone pins on it."""
    if isinstance(exc, (MessageSizeExceededError, ServiceBusAuthorizationError, ValueError, TypeError)):
        return True
    # The SDK keeps the AMQP condition it mapped from (no public accessor); its text ends the message.
    condition = str(getattr(exc, "_condition", "") or "")
    return isinstance(exc, ServiceBusError) and (_NOT_ALLOWED in condition or _NOT_ALLOWED in str(exc))


def publish_error(exc: BaseException, message_id: str, entity: str, *, alone: bool) -> PublishError:
    """The :class:`PublishError` for ``exc`` raised while sending ``message_id`` to ``entity``.
    ``alone`` says whether this message was sent by itself: only then is a refusal permanent."""
    if isinstance(exc, PublishError):
        return exc
    if isinstance(exc, ENTITY_MISSING):
        return PublishError(
            f"cannot publish message_id={message_id}: {describe(exc)} ({entity!r})", transient=False
        )
    if alone and is_refusal(exc):
        return PublishError(
            f"Service Bus refused message_id={message_id} to {entity!r}: {describe(exc)}", permanent=True
        )
    if isinstance(exc, TimeoutError):
        return PublishError(f"publish of message_id={message_id} to {entity!r} not confirmed in time")
    return PublishError(f"publish of message_id={message_id} to {entity!r} not confirmed: {describe(exc)}")


def dead_letter_error(
    exc: Exception, *, what: str, entity: str, dead_letters: str, where: str, call_timeout: float,
) -> Exception:
    """The :class:`ConfigurationError` (a user can fix it) or :class:`ConnectionError` for an SDK
    call ``what`` (``"peek"``, ``"send"``, ...) of ``consumer-kit dlq`` that failed with ``exc``, on
    the ``entity`` whose dead-letter sub-queue is ``dead_letters``, in the namespace ``where``;
    ``call_timeout`` seconds bound each call."""
    if isinstance(exc, ENTITY_MISSING):
        return ConfigurationError(
            f"no Service Bus queue or subscription {entity!r} at {where} ({describe(exc)}); "
            "a subscription is written topic/Subscriptions/name"
        )
    if isinstance(exc, ServiceBusAuthorizationError):
        return ConfigurationError(
            f"{where} refused {what} on {dead_letters}: {describe(exc)} (consumer-kit dlq "
            "needs Listen rights, and Send to redrive)"
        )
    if isinstance(exc, TimeoutError):
        return ConnectionError(
            f"Service Bus at {where} did not answer {what} on {dead_letters} within {call_timeout:g} s"
        )
    return ConnectionError(f"{what} on {dead_letters} at {where} failed: {describe(exc)}")


class TooLarge(Exception):
    """This message cannot be sent as it is. ``str(error)`` names the limit and the body's size in
    bytes, never the payload."""

    def __init__(self, text: str, *, limit: int) -> None:
        super().__init__(text)
        self.limit = limit


class HeaderTooLarge(ValueError):
    """A message breaks a header limit; ``str(error)`` names the property and the sizes (bytes)."""
