"""Message sizes SQS counts, checked before every send, and trimming a copy to fit.

SQS refuses a message larger than the queue's ``MaximumMessageSize`` (:attr:`~consumer_kit.adapters.sqs.topology.
QueueInfo.max_message_size`, default 256 KiB) and a ``SendMessageBatch`` of more than
:data:`BATCH_MAX_BYTES` in all; it counts::

    message size = UTF-8 bytes of the body
                 + for each attribute: bytes of its name + its data type + its value

:func:`size_of` measures a message that way; :func:`fit` drops headers from a copy (retry, release,
dead-letter, redrive) until it fits, or says it cannot (:mod:`consumer_kit.broker.kit.copy_fit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from consumer_kit.broker.kit.copy_fit import fit_copy
from consumer_kit.codec import headers as own

from .envelope import PRIORITY, Attributes, as_text, attributes_for

BATCH_MAX_BYTES = 1_048_576
"""The most bytes of messages one ``SendMessageBatch`` carries (SQS: 1 MiB)."""


def size_of(body: str, attributes: Mapping[str, Mapping[str, Any]]) -> int:
    """Bytes SQS counts for a message (formula in the module docstring)."""
    size = len(body.encode("utf-8"))
    for name, attribute in attributes.items():
        value = attribute.get("StringValue", attribute.get("BinaryValue", b""))
        value_size = len(value) if isinstance(value, bytes) else len(str(value).encode("utf-8"))
        size += len(name.encode("utf-8")) + len(str(attribute.get("DataType", "")).encode("utf-8")) + value_size
    return size


def fit(
    body: str, headers: Mapping[str, Any], limit: int, *, droppable: Iterable[str]
) -> tuple[Attributes, list[str]]:
    """Attributes for a copy of ``body`` with ``headers`` (signed) that fit ``limit`` bytes, and the
    names of the headers left out to make it fit (:func:`consumer_kit.broker.kit.copy_fit.fit_copy`): first
    every header not in :data:`PRIORITY` (largest first), then ``droppable`` in its order.

    Raises:
        ValueError: it does not fit even without them (the message names both sizes).
    """
    encoded = body.encode("utf-8")

    def measure(current: dict[str, Any]) -> tuple[Attributes, int]:
        attributes = attributes_for(own.seal(dict(current), encoded))
        return attributes, size_of(body, attributes)

    return fit_copy(headers, measure, limit, kept=PRIORITY, droppable=droppable, size=lambda value: len(as_text(value)))
