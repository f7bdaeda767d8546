"""Message sizes JetStream counts, checked before every publish, and trimming a copy to fit.

A NATS server refuses a message larger than its ``max_payload`` (``INFO``; 1 MiB by default) and
a stream one larger than its ``max_msg_size``; both count the header block and the body::

    size = len("NATS/1.0\\r\\n") + sum(len(f"{name}: {value}\\r\\n")) + len("\\r\\n") + len(body)

(no headers: the body alone). :func:`size_of` measures it that way; :func:`fit` drops headers from
a copy (retry, release, dead-letter, redrive) until it fits, or says it cannot
(:mod:`consumer_kit.broker.kit.copy_fit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from consumer_kit.broker.kit.copy_fit import fit_copy
from consumer_kit.codec import headers as own

from .envelope import headers_for

KEPT = (
    own.SIGNATURE, own.DEAD_LETTER_REASON, own.MESSAGE_ID, own.DELIVERIES, own.REDELIVERED,
    own.OPERATION_ID, own.TENANT, own.MESSAGE_TYPE, own.PARTITION_KEY, own.OPERATION_CREATED_AT,
)
"""Headers a copy keeps as long as anything else can go."""


def size_of(body: bytes, headers: Mapping[str, str]) -> int:
    """Bytes NATS counts for a message (formula in the module docstring)."""
    if not headers:
        return len(body)
    block = 10 + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items()) + 2
    return block + len(body)


def limit_of(max_payload: int, max_msg_size: int) -> int:
    """The bytes a message may have: the server's ``max_payload``, or the stream's smaller limit."""
    return min(max_payload, max_msg_size) if max_msg_size > 0 else max_payload


def fit(body: bytes, headers: Mapping[str, Any], limit: int, *, droppable: Iterable[str] = (),
        extra: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """NATS headers for a copy of ``body`` with ``headers`` (signed) plus ``extra`` (unsigned:
    ``Nats-Msg-Id``) that fit ``limit`` bytes, and the names left out to make it fit
    (:func:`consumer_kit.broker.kit.copy_fit.fit_copy`): first every header not in :data:`KEPT` (largest
    first), then ``extra`` (a copy's de-duplication id is only a convenience), then ``droppable``
    in its order.

    Raises:
        ValueError: it does not fit even without them (the message names both sizes).
    """
    spare = dict(extra or {})

    def measure(current: dict[str, Any]) -> tuple[dict[str, str], int]:
        signed = {n: v for n, v in current.items() if n not in spare}
        sent = {**headers_for(own.seal(signed, body)), **{n: current[n] for n in spare if n in current}}
        return sent, size_of(body, sent)

    return fit_copy({**headers, **spare}, measure, limit, kept=KEPT, droppable=(*spare, *droppable),
                    size=lambda value: len(str(value)))
