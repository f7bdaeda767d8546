"""What a RabbitMQ failure means: the broker's reply, one-line descriptions, PublishError kinds.

Classification of a failed publish (``consumer_kit.broker.publishing.PublishError``):

=============================================================  ==========  =========================
cause                                                          kind        why
=============================================================  ==========  =========================
too large for ``frame_max`` or ``max_message_size``, headers   permanent   the same bytes fail the
that cannot be encoded (checked before sending)                            same way every time
channel closed with 406 PRECONDITION_FAILED (destination of    permanent   the broker refuses this
another type or arguments), 404 NOT_FOUND, 403 ACCESS_REFUSED,             message as addressed
connection closed with 501 FRAME_ERROR, *when this message
alone caused it* (its own declaration channel, or an isolated
publish)
returned by the default exchange (no queue of that name)       row         a queue may appear later
broker nack, confirm timeout, connection or channel lost,      transient   the broker or the network
any close caused by another message on a shared channel                    is at fault; retry soon
=============================================================  ==========  =========================
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import aiormq.abc
import aiormq.exceptions

from consumer_kit.broker.publishing import OutgoingMessage
from consumer_kit.errors import PublishError

from .config import vhost_of

logger = logging.getLogger(__name__)


class VhostUnavailable(ConnectionError):
    """The broker closed the connection when it was asked to open the URL's vhost: the vhost
    does not exist, or the user has no permission on it (RabbitMQ answers both the same way)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        vhost = vhost_of(url)
        user = parts.username or "guest"
        super().__init__(
            f"vhost {vhost!r} does not exist or user {user!r} may not use it (rabbitmqctl "
            f"add_vhost {vhost}; rabbitmqctl set_permissions -p {vhost} {user} '.*' '.*' '.*')"
        )
        self.vhost = vhost


def is_vhost_refusal(exc: BaseException) -> bool:
    """True for aiormq's answer to a Connection.Close in reply to Connection.Open (an
    ``InvalidFrameError`` "Expected ... Connection.OpenOk, got <Connection.Close ...>"), which is
    how RabbitMQ refuses a vhost that is missing or not permitted."""
    text = str(exc)
    return (
        isinstance(exc, aiormq.exceptions.InvalidFrameError)
        and "Connection.OpenOk" in text and "Connection.Close" in text
    )


REFUSED = (
    aiormq.exceptions.AuthenticationError,
    aiormq.exceptions.ProbableAuthenticationError,
    aiormq.exceptions.ConnectionNotAllowed,
    VhostUnavailable,
)
"""Connection errors that retrying cannot fix (credentials, permissions, missing vhost)."""

# Reply codes that refuse a message as addressed: no retry makes them succeed.
_REFUSING_CODES = {
    403: "ACCESS_REFUSED",
    404: "NOT_FOUND",
    406: "PRECONDITION_FAILED",
    501: "FRAME_ERROR",
}
_CODE_OF = {
    aiormq.exceptions.ChannelAccessRefused: 403,
    aiormq.exceptions.ChannelNotFoundEntity: 404,
    aiormq.exceptions.ChannelLockedResource: 405,
    aiormq.exceptions.ChannelPreconditionFailed: 406,
    aiormq.exceptions.ConnectionFrameError: 501,
}


def describe(exc: BaseException | None) -> str:
    """``"ErrorClass: first line"`` of an exception, for one-line logs and errors."""
    if exc is None:
        return "unknown error"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def reply_of(exc: BaseException) -> tuple[int | None, str]:
    """``(reply code, reply text)`` of a channel or connection the broker closed; ``(None, "")``
    for anything else. aiormq raises a subclass carrying only the text for known codes and
    ``ChannelClosed(code, text)`` / ``ConnectionClosed(code, text)`` for the rest."""
    if not isinstance(exc, (aiormq.exceptions.ChannelClosed, aiormq.exceptions.ConnectionClosed)):
        return None, ""
    code = _CODE_OF.get(type(exc))
    args = exc.args
    if code is not None:
        return code, str(args[0]) if args else ""
    if len(args) >= 2 and isinstance(args[0], int):
        return args[0], str(args[1])
    return None, str(args[0]) if args else ""


def is_refusal(exc: BaseException) -> bool:
    """True when the broker closed the channel (or connection) refusing the message as
    addressed: 403, 404, 406 or 501 (table in the module docstring)."""
    code, _ = reply_of(exc)
    return code in _REFUSING_CODES


def publish_error(exc: BaseException, message_id: str, destination: str, *, alone: bool) -> PublishError:
    """The :class:`PublishError` for ``exc`` raised while publishing ``message_id`` to
    ``destination``. ``alone`` says whether this message alone could have caused it (its own
    declaration channel or an isolated publish): only then is a refusal permanent."""
    if isinstance(exc, PublishError):
        return exc
    code, text = reply_of(exc)
    if alone and code in _REFUSING_CODES:
        return PublishError(
            f"broker refused message_id={message_id} to {destination!r}: {text or describe(exc)}",
            permanent=True,
        )
    if isinstance(exc, aiormq.exceptions.DeliveryError):
        return PublishError(f"broker nacked message_id={message_id}")
    if isinstance(exc, TimeoutError):
        return PublishError(f"publish of message_id={message_id} to {destination!r} not confirmed in time")
    return PublishError(
        f"publish of message_id={message_id} to {destination!r} not confirmed: "
        f"{text or describe(exc)}"
    )


class Unsendable(Exception):
    """This message cannot be published as it is (too large for a limit, or headers that cannot
    be encoded). ``str(error)`` names the limit and the size in bytes; never the payload."""

    def __init__(self, text: str, *, size: int | None = None, limit: int | None = None) -> None:
        super().__init__(text)
        self.size = size
        self.limit = limit


def check_returned(message: OutgoingMessage, result: object) -> None:
    """Judge a confirmed publish's ``result``: a message RabbitMQ returned (``mandatory``, nothing
    bound) to the default exchange names no queue, so it is a row error; returned from another
    exchange it was published unrouted (logged).

    Raises:
        PublishError: no queue named by the routing key (``transient=False``).
    """
    if isinstance(result, aiormq.abc.DeliveredMessage):  # returned: nothing bound
        if message.destination == "":
            raise PublishError(
                f"no queue {message.routing_key!r} for message_id={message.message_id}",
                transient=False,
            )
        logger.debug(
            "no binding on exchange %s for routing key %s; message_id=%s published unrouted",
            message.destination, message.routing_key, message.message_id,
        )
        return
    logger.debug(
        "published message_id=%s to exchange=%s routing_key=%s",
        message.message_id, message.destination, message.routing_key,
    )

