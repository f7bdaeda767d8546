"""How a delivery was finished (docs/explanation/architecture.md, "Words"); adapters import it from :mod:`consumer_kit.broker`."""

from __future__ import annotations

import enum


class Settlement(enum.StrEnum):
    """How a delivery was finished."""

    ACK = "ack"
    RETRY = "retry"
    DEAD_LETTER = "dead_letter"
    RELEASED = "released"  # given back uncounted (shutdown, environment fault, isolation)
