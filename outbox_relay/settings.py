"""Relay settings: the shared ``CONSUMER_KIT_`` settings plus the relay's own ``CONSUMER_KIT_RELAY_*``.

Every field is an environment variable with prefix ``CONSUMER_KIT_`` (``CONSUMER_KIT_DATABASE_URL``,
``CONSUMER_KIT_BROKER_URL``, ``CONSUMER_KIT_DB_SCHEMA``, ``CONSUMER_KIT_RELAY_BATCH_SIZE``, ...).
Durations are in seconds.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from consumer_kit.settings import Settings


class RouteTarget(BaseModel):
    """Where one outbox destination goes on the broker.

    Attributes:
        exchange: RabbitMQ exchange (durable topic exchange, declared by the publisher).
        routing_key: fixed routing key; ``None`` keeps the row's own routing key.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    exchange: str
    routing_key: str | None = None


def default_relay_id() -> str:
    """``<host>:<pid>:<4 hex>``: unique per relay process, readable in ``claimed_by``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:4]}"


class RelaySettings(Settings):
    """Settings of ``outbox-relay`` (all durations in seconds).

    Raises (on construction):
        pydantic.ValidationError: a value out of range.
    """

    relay_id: str = Field(default_factory=default_relay_id, description="Written to claimed_by.")
    relay_batch_size: int = Field(default=200, ge=1, le=10_000, description="Rows claimed per batch.")
    relay_max_in_flight: int = Field(
        default=256, ge=1, le=10_000, description="Unconfirmed publishes at once."
    )
    relay_poll_interval: float = Field(
        default=2.0, gt=0, description="Fallback poll when no NOTIFY arrives (lost or missed)."
    )
    relay_claim_timeout: float = Field(
        default=60.0, gt=0, description="Claim lease: another relay takes rows over after it."
    )
    relay_max_attempts: int = Field(
        default=20, ge=1, description="Failed publishes before a row is parked (never deleted)."
    )
    relay_backoff_base: float = Field(default=1.0, gt=0, description="First retry delay.")
    relay_backoff_max: float = Field(default=300.0, gt=0, description="Longest retry delay.")
    relay_transient_backoff_max: float = Field(
        default=5.0, gt=0,
        description="Longest retry delay after a broker/connection failure (such rows never park).",
    )
    relay_ordered: bool = Field(
        default=True,
        description="Publish rows of one partition key one at a time in commit order.",
    )
    relay_retention: float = Field(
        default=7 * 24 * 3600.0, ge=0, description="Keep published rows this long."
    )
    relay_cleanup_interval: float = Field(default=60.0, gt=0, description="Cleanup pass period.")
    relay_cleanup_batch: int = Field(default=1000, ge=1, description="Rows deleted per statement.")
    relay_destinations: dict[str, RouteTarget] | None = Field(
        default=None,
        description="Destination map (JSON in env). Unset: destination = exchange of that name.",
    )
    relay_destinations_file: Path | None = Field(
        default=None, description="TOML or JSON file with a [destinations] table."
    )
    relay_health_file: Path | None = Field(default=None, description="Touched on every loop.")
    relay_health_port: int | None = Field(
        default=None, ge=0, le=65535, description="Tiny HTTP health endpoint on 127.0.0.1."
    )

    @property
    def publish_deadline(self) -> float:
        """Seconds a batch may spend publishing: 80 % of the claim lease, so this relay has
        stopped publishing a row before another relay may take it over."""
        return self.relay_claim_timeout * 0.8
