"""Trimming a copy to fit: which headers a copy leaves out when it is too large, in what order.

A copy that consumer-kit sends of a delivery (retry, release, dead-letter, redrive) is checked
against the target's size limit before it is sent (docs/explanation/faults-and-attempts.md: no single
message may close a connection others share). When it does not fit, :func:`fit_copy` leaves
headers out until it does: first every header that is neither kept nor droppable, largest first,
then the droppable ones in their order; a kept header never. After each drop the copy is measured
again as it would be sent, so a signature made there covers exactly the marks the copy keeps. A
copy that does not fit even then is never sent.

The adapter says how its broker measures a message, which headers it keeps and how large a value
is (:mod:`consumer_kit.adapters.nats.limits`, :mod:`consumer_kit.adapters.sqs.limits`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any, TypeVar

S = TypeVar("S")


def fit_copy(
    headers: Mapping[str, Any],
    measure: Callable[[dict[str, Any]], tuple[S, int]],
    limit: int,
    *,
    kept: Container[str],
    droppable: Iterable[str] = (),
    size: Callable[[Any], int],
) -> tuple[S, list[str]]:
    """``(sent, dropped)``: what ``measure`` made of the largest subset of ``headers`` that fits
    ``limit`` bytes, in the order of the module docstring, and the names left out.

    Args:
        headers: the copy's headers, all of them.
        measure: ``headers -> (what is sent, its size in bytes)``; it may sign them.
        limit: bytes the target takes.
        kept: names never left out.
        droppable: names left out last, in this order.
        size: the size of a header value, to rank the others (largest first).

    Raises:
        ValueError: it does not fit even without them (the message names both sizes).
    """
    current = dict(headers)
    last = [name for name in droppable if name in current]
    order = sorted((n for n in current if n not in kept and n not in last), key=lambda n: -size(current[n]))
    order += last
    dropped: list[str] = []
    while True:
        sent, measured = measure(current)
        if measured <= limit:
            return sent, dropped
        if not order:
            raise ValueError(f"a copy of {measured} bytes exceeds the maximum message size of {limit} bytes")
        name = order.pop(0)
        del current[name]
        dropped.append(name)
