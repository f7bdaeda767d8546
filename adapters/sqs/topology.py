"""Queue names, URLs and ARNs, and what the adapter reads from a queue's attributes.

A queue is named one of three ways:

* an **https URL** (``https://sqs.eu-west-1.amazonaws.com/123456789012/orders``): used as it is;
* an **ARN** (``arn:aws:sqs:eu-west-1:123456789012:orders``): its name and owner account are
  looked up with ``GetQueueUrl``;
* a **consumer-kit queue name** (``invoices.commands``): SQS names allow only ``A-Z a-z 0-9 - _``
  (at most 80, FIFO names end in ``.fifo``), so every other character becomes ``-``
  (``invoices.commands`` -> ``invoices-commands``, ``orders.fifo`` stays ``orders.fifo``); looked up
  with ``GetQueueUrl`` in the URL's account.

From ``GetQueueAttributes`` the adapter takes ``MaximumMessageSize`` (bytes: every send is
checked against it first), ``VisibilityTimeout`` (seconds: the peek-lock when the URL sets
none), ``FifoQueue``, ``QueueArn`` and ``RedrivePolicy`` (``deadLetterTargetArn``,
``maxReceiveCount``).

**Dead-letter queue** of a work queue: its redrive policy's target when it has one (so one DLQ
holds both consumer-kit's reasoned dead letters and SQS's own redrives), else ``<name>-dlq``
(``<name>-dlq.fifo`` for FIFO). ``consumer-kit declare`` (and a worker with ``create_queues=true``)
creates a missing work queue with a redrive policy to a new ``-dlq`` queue (``maxReceiveCount`` =
:func:`recommended_max_receive_count`), and a missing event destination as a plain queue;
otherwise a missing queue is a start-up error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass

from consumer_kit.errors import ConfigurationError

from .connection import SQSClient
from .errors import NON_EXISTENT_QUEUE, describe, is_code

logger = logging.getLogger(__name__)

FIFO_SUFFIX = ".fifo"
DLQ_SUFFIX = "-dlq"
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_-]")
_ARN = re.compile(r"^arn:aws[\w-]*:sqs:(?P<region>[^:]*):(?P<account>\d{12}):(?P<name>[^:]+)$")


def recommended_max_receive_count(max_deliveries: int, crash_limit: int) -> int:
    """``maxReceiveCount`` for a work queue's redrive policy: a loop guard well above
    consumer-kit's own bounds, ``max(50, 5 * (max_deliveries + crash_limit))`` (the same rule as
    RabbitMQ's ``x-delivery-limit``)."""
    return max(50, 5 * (max_deliveries + crash_limit))


def sqs_queue_name(name: str) -> str:
    """The SQS queue name for a consumer-kit queue name (module docstring).

    Raises:
        ConfigurationError: the result is empty or longer than 80 characters.
    """
    fifo = name.endswith(FIFO_SUFFIX)
    base = name[: -len(FIFO_SUFFIX)] if fifo else name
    result = _NOT_ALLOWED.sub("-", base) + (FIFO_SUFFIX if fifo else "")
    if not base or len(result) > 80:
        raise ConfigurationError(f"{name!r} cannot be an SQS queue name (1 to 80 characters)")
    return result


def dead_letter_name(queue_name: str) -> str:
    """``<name>-dlq`` (``<name>-dlq.fifo`` for a FIFO queue)."""
    if queue_name.endswith(FIFO_SUFFIX):
        return queue_name[: -len(FIFO_SUFFIX)] + DLQ_SUFFIX + FIFO_SUFFIX
    return queue_name + DLQ_SUFFIX


@dataclass(frozen=True)
class RedrivePolicy:
    """A queue's ``RedrivePolicy``: SQS moves a message received ``max_receive_count`` times to
    ``dead_letter_arn``."""

    dead_letter_arn: str
    max_receive_count: int


@dataclass(frozen=True)
class QueueInfo:
    """One SQS queue as the adapter uses it.

    Attributes:
        name: the SQS queue name.
        url: the queue URL every call takes.
        arn: the queue ARN.
        fifo: a FIFO queue (``MessageGroupId`` required, order per group).
        max_message_size: bytes (``MaximumMessageSize``).
        visibility_timeout: seconds (the queue's ``VisibilityTimeout``).
        redrive: the redrive policy, if any.
    """

    name: str
    url: str
    arn: str
    fifo: bool
    max_message_size: int
    visibility_timeout: int
    redrive: RedrivePolicy | None


class QueueDirectory:
    """Looks queues up (cached per target) and creates missing ones when asked.

    Args:
        client: the adapter's :class:`~consumer_kit.adapters.sqs.connection.SQSClient`.
        account_id: owner of queues named by plain name (``None``: the caller's account).
        max_receive_count: ``maxReceiveCount`` of the redrive policy of created queues.
    """

    def __init__(
        self,
        client: SQSClient,
        *,
        account_id: str | None = None,
        max_receive_count: int = 50,
    ) -> None:
        self._client = client
        self._account_id = account_id
        self._max_receive_count = max_receive_count
        self._cache: dict[str, QueueInfo] = {}
        self._lookups: dict[str, asyncio.Task[QueueInfo]] = {}

    async def lookup(self, target: str) -> QueueInfo:
        """The queue ``target`` names (URL, ARN or consumer-kit name). Concurrent lookups of one
        uncached target share one pair of calls and all resume together, so publishes that
        arrived together still go out in one batch.

        Raises:
            LookupError: no such queue.
            botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError: SQS refused or
                did not answer.
        """
        cached = self._cache.get(target)
        if cached is not None:
            return cached
        task = self._lookups.get(target)
        if task is None:
            # one-shot: one lookup per target, shared by every caller waiting on it
            task = asyncio.create_task(self._fetch(target), name=f"consumer-kit sqs lookup {target}")
            self._lookups[target] = task
            task.add_done_callback(lambda _: self._lookups.pop(target, None))
        # shielded: one caller giving up (its own timeout) does not fail the others
        return await asyncio.shield(task)

    async def _fetch(self, target: str) -> QueueInfo:
        try:
            url = await self._url_of(target)
        except Exception as exc:
            if is_code(exc, NON_EXISTENT_QUEUE):
                raise LookupError(f"no SQS queue {target!r} ({describe(exc)})") from exc
            raise
        info = await self._read(url)
        self._cache[target] = info
        return info

    async def ensure(self, target: str, *, dead_letters: bool) -> QueueInfo:
        """:meth:`lookup`, creating a missing queue named by a consumer-kit name first: with
        ``dead_letters``, a work queue with a redrive policy to a new ``-dlq`` queue (module
        docstring); without, a plain queue (an event destination). FIFO when the name ends in
        ``.fifo``. Idempotent.

        Raises:
            LookupError: a URL or ARN names no queue (those are never created).
            botocore errors: SQS refused (e.g. no ``sqs:CreateQueue`` permission) or did not answer.
        """
        try:
            return await self.lookup(target)
        except LookupError:
            if target.startswith(("https://", "http://", "arn:")):
                raise
        name = sqs_queue_name(target)
        if dead_letters:
            await self._create_with_dlq(name)
        else:
            await self._client.call("create_queue", QueueName=name, Attributes=_fifo(name))
            logger.info("created SQS queue %s", name)
        return await self.lookup(target)

    async def dead_letter_queue(self, queue: QueueInfo) -> QueueInfo:
        """Where dead letters of ``queue`` go (module docstring).

        Raises:
            ConfigurationError: there is none.
        """
        target = queue.redrive.dead_letter_arn if queue.redrive else dead_letter_name(queue.name)
        try:
            return await self.lookup(target)
        except LookupError:
            raise ConfigurationError(
                f"SQS queue {queue.name} has no redrive policy and no {dead_letter_name(queue.name)} "
                "queue: create a dead-letter queue (or use create_queues=true for local development)"
            ) from None

    def forget(self, target: str) -> None:
        """Drop ``target`` from the cache (its queue was deleted or changed)."""
        self._cache.pop(target, None)

    async def _url_of(self, target: str) -> str:
        if target.startswith(("https://", "http://")):
            return target
        params: dict[str, str] = {}
        arn = _ARN.fullmatch(target)
        if arn is not None:
            params = {"QueueName": arn["name"], "QueueOwnerAWSAccountId": arn["account"]}
        else:
            params = {"QueueName": sqs_queue_name(target)}
            if self._account_id:
                params["QueueOwnerAWSAccountId"] = self._account_id
        reply = await self._client.call("get_queue_url", **params)
        return str(reply["QueueUrl"])

    async def _read(self, url: str) -> QueueInfo:
        reply = await self._client.call("get_queue_attributes", QueueUrl=url, AttributeNames=["All"])
        attributes = reply.get("Attributes", {})
        redrive = None
        if attributes.get("RedrivePolicy"):
            policy = json.loads(attributes["RedrivePolicy"])
            redrive = RedrivePolicy(str(policy["deadLetterTargetArn"]), int(policy["maxReceiveCount"]))
        return QueueInfo(
            name=url.rstrip("/").rsplit("/", 1)[-1],
            url=url,
            arn=str(attributes.get("QueueArn", "")),
            fifo=str(attributes.get("FifoQueue", "false")).lower() == "true",
            max_message_size=int(attributes.get("MaximumMessageSize", 262_144)),
            visibility_timeout=int(attributes.get("VisibilityTimeout", 30)),
            redrive=redrive,
        )

    async def _create_with_dlq(self, name: str) -> str:
        fifo = _fifo(name)
        dlq = await self._client.call("create_queue", QueueName=dead_letter_name(name), Attributes=fifo)
        dlq_info = await self._read(str(dlq["QueueUrl"]))
        policy = {"deadLetterTargetArn": dlq_info.arn, "maxReceiveCount": self._max_receive_count}
        created = await self._client.call(
            "create_queue", QueueName=name, Attributes={**fifo, "RedrivePolicy": json.dumps(policy)}
        )
        logger.info("created SQS queue %s with dead-letter queue %s", name, dlq_info.name)
        return str(created["QueueUrl"])


def _fifo(name: str) -> dict[str, str]:
    return {"FifoQueue": "true"} if name.endswith(FIFO_SUFFIX) else {}
