"""Names, arguments and declarations of the queues and exchanges consumer-kit uses on RabbitMQ.

For a work queue ``<queue>`` (all durable, quorum by default):

* ``<queue>``: dead-letters through the default exchange to ``<queue>.dlq``
  (``x-dead-letter-exchange=""``, ``x-dead-letter-routing-key=<queue>.dlq``); quorum queues also
  get ``x-delivery-limit`` (:func:`broker_delivery_limit`) and
  ``x-dead-letter-strategy=at-least-once`` (with ``x-overflow=reject-publish``, which that
  strategy requires).
* ``<queue>.dlq``: the dead-letter queue, which must never drop what it holds. ``consumer-kit dlq
  list`` and a selective ``dlq redrive`` browse it with ``basic.get`` and put messages back by
  closing their channel, and a quorum queue counts that as a delivery. Since RabbitMQ 4.0 every
  quorum queue has a delivery limit (default 20; RabbitMQ's quorum queue guide, "Repeatedly
  Requeued Deliveries": "a delivery limit of -1" restores the unlimited behaviour), and a DLQ has
  no DLX: past the limit a dead letter is dropped. So on RabbitMQ 4.x a quorum DLQ is declared
  with ``x-delivery-limit=-1``. On 3.x nothing is set: there an unset limit is unlimited, and -1
  is *not* (measured on 3.10.8: a quorum queue with ``x-delivery-limit=-1`` dropped a message
  after its first return; with no limit it survived 25). :func:`dead_letter_queue_drops` warns at
  start about an existing DLQ that would drop (a policy's ``delivery-limit`` is not visible to
  a client: check ``rabbitmqctl list_policies``).
* ``<queue>.retry.<ms>ms``: one retry queue per delay tier, ``x-message-ttl=<ms>``,
  dead-lettering back to ``<queue>`` through the default exchange. RabbitMQ has no
  delayed-message plugin here, and per-message ``expiration`` only expires at the head of a
  queue, hence one queue per tier.

Declarations are tolerant: a queue that exists with other arguments is used as it is, with a
WARNING naming each difference (once per queue and process). Every declaration runs on a channel
of its own, because a refused declaration (406 PRECONDITION_FAILED) closes its channel.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection

logger = logging.getLogger(__name__)

QUEUE_TYPES = ("quorum", "classic")


def broker_delivery_limit(max_deliveries: int, crash_limit: int = 3) -> int:
    """The ``x-delivery-limit`` declared on a quorum work queue: a loop guard only,
    ``max(50, 5 * (max_deliveries + crash_limit))``.

    consumer-kit decides dead-lettering and parking from its own counts in the ledger (at most
    ``max_deliveries`` handler faults, ``crash_limit`` crashes); releases (shutdowns, outages)
    republish an uncounted copy. So the broker only ever counts deliveries whose settlement was
    lost or whose worker died, and this limit only catches a message that keeps escaping
    consumer-kit's own bookkeeping (a loop outside our control). Five times our own bounds, and
    never below 50, keeps it well out of the way of any legitimate history.
    """
    return max(50, 5 * (max_deliveries + crash_limit))


def broker_version(connection: AbstractConnection) -> tuple[int, ...] | None:
    """RabbitMQ's version from the connection's ``server_properties`` (``(3, 10, 8)``), or
    ``None`` when it does not say."""
    transport = getattr(connection, "transport", None)
    properties = getattr(getattr(transport, "connection", None), "server_properties", None) or {}
    raw = properties.get("version")
    text = raw.decode() if isinstance(raw, bytes) else str(raw or "")
    parts = re.findall(r"\d+", text)[:3]
    return tuple(int(p) for p in parts) or None


def dead_letter_queue_arguments(queue_type: str, version: tuple[int, ...] | None) -> dict[str, Any]:
    """The ``<queue>.dlq`` arguments that never drop a dead letter (module docstring): quorum on
    RabbitMQ 4.x: ``x-delivery-limit=-1``; quorum on 3.x (or a broker that names no version, as
    every RabbitMQ does): no limit (unset is unlimited before 4.0); classic: none."""
    if queue_type != "quorum":
        return {}
    args: dict[str, Any] = {"x-queue-type": "quorum"}
    if version is not None and version[0] >= 4:
        args["x-delivery-limit"] = -1
    return args


def dead_letter_queue_drops(
    arguments: Mapping[str, Any], queue_type: str, version: tuple[int, ...] | None
) -> str | None:
    """Why an existing DLQ with ``arguments`` would drop dead letters that ``dlq list`` browses
    (``None``: it would not, as far as its arguments show)."""
    quorum = arguments.get("x-queue-type", queue_type) == "quorum"
    if not quorum or "x-dead-letter-exchange" in arguments:
        return None
    limit = arguments.get("x-delivery-limit")
    four = version is not None and version[0] >= 4
    if isinstance(limit, int) and limit >= 0:
        return f"x-delivery-limit={limit}: a dead letter is dropped after {limit} browses (dlq list, redrive)"
    if limit is None and four:
        return ("no x-delivery-limit on RabbitMQ 4.x: the default of 20 applies, a dead letter is "
                "dropped after about 20 browses (dlq list, redrive); set a policy delivery-limit=-1")
    if isinstance(limit, int) and limit < 0 and not four:
        return (f"x-delivery-limit={limit} on RabbitMQ 3.x: a negative limit drops a dead letter at its "
                "first browse; remove the argument (unset is unlimited before 4.0)")
    return None


def _ms(delay: float) -> int:
    return round(delay * 1000)


@dataclass(frozen=True)
class QueueNames:
    """Queue names of one subscription."""

    queue: str
    dlq: str
    retry_tiers: tuple[tuple[float, str], ...]  # (delay in seconds, queue name), ascending

    @classmethod
    def for_queue(cls, queue: str, retry_delays: Sequence[float]) -> QueueNames:
        tiers = sorted({_ms(d) for d in retry_delays if _ms(d) > 0})
        return cls(
            queue=queue,
            dlq=f"{queue}.dlq",
            retry_tiers=tuple((ms / 1000, f"{queue}.retry.{ms}ms") for ms in tiers),
        )

    def retry_queue_for(self, delay: float) -> str:
        """The smallest tier >= ``delay`` seconds (or the largest); the work queue itself for
        ``delay`` 0 or when there are no tiers."""
        if delay <= 0 or not self.retry_tiers:
            return self.queue
        for tier_delay, name in self.retry_tiers:
            if tier_delay >= delay:
                return name
        return self.retry_tiers[-1][1]


@dataclass
class Declared:
    """How a queue was (or must be re-)declared: the arguments it actually has."""

    durable: bool = True
    arguments: dict[str, Any] = field(default_factory=dict)
    passive: bool = False


class QueueDeclarer:
    """Declares a subscription's queues with the wanted arguments (module docstring), warning
    once per queue about existing queues that differ.

    Args:
        queue_type: ``"quorum"`` or ``"classic"``.
        delivery_limit: ``x-delivery-limit`` for quorum work queues (:func:`broker_delivery_limit`).
        max_deliveries: only for the start-up warning about an existing lower limit.
    """

    def __init__(self, *, queue_type: str, delivery_limit: int, max_deliveries: int) -> None:
        if queue_type not in QUEUE_TYPES:
            raise ValueError(f"queue_type must be one of {QUEUE_TYPES}, not {queue_type!r}")
        self.queue_type = queue_type
        self.delivery_limit = delivery_limit
        self.max_deliveries = max_deliveries
        self._warned: set[str] = set()

    def work_queue_arguments(self, names: QueueNames) -> dict[str, Any]:
        args: dict[str, Any] = {
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": names.dlq,
        }
        if self.queue_type == "quorum":
            args["x-delivery-limit"] = self.delivery_limit
        return self._typed(args)

    def _typed(self, args: dict[str, Any]) -> dict[str, Any]:
        if self.queue_type == "quorum":
            args = {"x-queue-type": "quorum", **args}
            if "x-dead-letter-exchange" in args:
                args["x-dead-letter-strategy"] = "at-least-once"
                args["x-overflow"] = "reject-publish"
        return args

    async def declare(self, connection: AbstractConnection, names: QueueNames) -> Declared:
        """Declare DLQ, retry queues and the work queue; return how to declare the work queue on
        the consuming channel.

        Raises:
            aio_pika.exceptions.AMQPError: the broker refused a declaration it cannot adapt to
                (e.g. access refused).
        """
        first_time = names.queue not in self._warned
        self._warned.add(names.queue)
        version = broker_version(connection)
        helpers: list[tuple[str, dict[str, Any]]] = [
            (names.dlq, dead_letter_queue_arguments(self.queue_type, version))
        ]
        for delay, name in names.retry_tiers:
            retry_args = {
                "x-message-ttl": _ms(delay),
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": names.queue,
            }
            helpers.append((name, self._typed(retry_args)))
        for name, args in helpers:
            helper = await declare_queue_tolerant(connection, name, args)
            if first_time and not helper.passive and helper.arguments != args:
                logger.warning(
                    "queue %s exists with arguments %s; consumer-kit would declare %s",
                    name, helper.arguments, args,
                )
            drops = dead_letter_queue_drops(helper.arguments, self.queue_type, version)
            if first_time and name == names.dlq and not helper.passive and drops:
                logger.warning("dead-letter queue %s would drop dead letters: %s", name, drops)
        wanted = self.work_queue_arguments(names)
        declared = await declare_queue_tolerant(connection, names.queue, wanted)
        if first_time:
            self._check_work_queue(names, wanted, declared)
        return declared

    def _check_work_queue(self, names: QueueNames, wanted: dict[str, Any], declared: Declared) -> None:
        if declared.passive:
            return  # already warned
        queue, existing = names.queue, declared.arguments
        if not declared.durable:
            logger.warning("queue %s exists and is not durable: messages die with the broker", queue)
        for arg in sorted(set(wanted) | set(existing)):
            if wanted.get(arg, _MISSING) == existing.get(arg, _MISSING):
                continue
            logger.warning(
                "queue %s exists with %s=%s; consumer-kit would declare %s; using the existing queue",
                queue, arg, existing.get(arg, "(none)"), wanted.get(arg, "(none)"),
            )
        limit = existing.get("x-delivery-limit")
        if isinstance(limit, int) and limit < self.max_deliveries:
            logger.warning(
                "queue %s has x-delivery-limit=%s below max_deliveries=%s: the broker dead-letters "
                "(or drops) a message before consumer-kit does",
                queue, limit, self.max_deliveries,
            )
        if "x-dead-letter-exchange" not in existing:
            logger.warning(
                "queue %s has no dead-letter settings: a message the broker dead-letters "
                "(delivery limit, rejection) is dropped instead of reaching %s",
                queue, names.dlq,
            )
        elif (
            existing.get("x-dead-letter-exchange") != ""
            or existing.get("x-dead-letter-routing-key") != names.dlq
        ):
            logger.warning(
                "queue %s dead-letters elsewhere than %s (exchange=%s routing_key=%s)",
                queue, names.dlq, existing.get("x-dead-letter-exchange"),
                existing.get("x-dead-letter-routing-key"),
            )


async def declare_queue_tolerant(
    connection: AbstractConnection, name: str, wanted: dict[str, Any]
) -> Declared:
    """Declare ``name`` durable with ``wanted`` arguments. When the queue exists with other
    arguments (PRECONDITION_FAILED, which closes the channel and names one argument), adopt the
    existing value and try again on a new channel, so the loop learns every difference; if the
    text can't be parsed, fall back to a passive declare (use the queue as it is)."""
    declared = Declared(durable=True, arguments=dict(wanted))
    for _ in range(len(wanted) + 4):
        channel = await connection.channel(publisher_confirms=False)
        try:
            await channel.declare_queue(
                name, durable=declared.durable, arguments=declared.arguments or None
            )
            return declared
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            parsed = parse_inequivalent(str(exc), wanted)
            if parsed is None:
                break
            arg, current = parsed
            if arg == "durable":
                declared.durable = bool(current)
            elif current is _MISSING:
                declared.arguments.pop(arg, None)
            else:
                declared.arguments[arg] = current
        finally:
            if not channel.is_closed:
                await channel.close()
    logger.warning(
        "queue %s exists with arguments consumer-kit cannot compare; using it as it is", name
    )
    channel = await connection.channel(publisher_confirms=False)
    try:
        await channel.declare_queue(name, passive=True)
    finally:
        if not channel.is_closed:
            await channel.close()
    return Declared(passive=True)


async def declare_topic_exchange(connection: AbstractConnection, name: str, timeout: float) -> None:
    """Declare the durable topic exchange ``name`` on a channel of its own, closed afterwards:
    a refusal (406 PRECONDITION_FAILED for an exchange of another type, 403 ACCESS_REFUSED)
    closes only that channel, never the one other messages are being published on.

    Raises:
        aiormq.exceptions.ChannelClosed: the broker refused it (the reply text says why).
        TimeoutError: no answer within ``timeout`` seconds.
    """
    channel = await connection.channel(publisher_confirms=False)
    try:
        await channel.declare_exchange(
            name, aio_pika.ExchangeType.TOPIC, durable=True, timeout=timeout
        )
    finally:
        if not channel.is_closed:
            await channel.close()


_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<arg>[^']+)' for queue .*?: "
    r"received (?P<received>.+?) but current is (?P<current>.+)$"
)
_TYPED_VALUE = re.compile(r"^the value '(?P<value>.*)' of type '(?P<type>\w+)'$")
_BARE_VALUE = re.compile(r"^'(?P<value>.*)'$")
_INT_TYPES = frozenset(
    {"byte", "short", "signedint", "long", "unsignedbyte", "unsignedshort", "unsignedint"}
)
_MISSING: Any = object()


def parse_inequivalent(text: str, wanted: Mapping[str, Any]) -> tuple[str, Any] | None:
    """Parse RabbitMQ's PRECONDITION_FAILED text into (argument, current value); the value is
    ``_MISSING`` when the existing queue lacks the argument. None when it can't be parsed."""
    match = _INEQUIVALENT.search(text)
    if match is None:
        return None
    arg, current = match["arg"], match["current"].strip()
    if current == "none":
        return arg, _MISSING
    typed = _TYPED_VALUE.match(current)
    bare = _BARE_VALUE.match(current)
    if typed is not None:
        value, kind = typed["value"], typed["type"]
    elif bare is not None:
        value, kind = bare["value"], ""
    else:
        return None
    numeric = value.lstrip("-").isdigit()
    if kind in _INT_TYPES or (kind == "" and isinstance(wanted.get(arg), int) and numeric):
        return arg, int(value)
    if kind == "bool" or arg == "durable":
        return arg, value == "true"
    return arg, value
