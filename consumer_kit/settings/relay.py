"""The ``outbox`` and ``relay`` groups: the relay's own ``CONSUMER_KIT_RELAY_*`` settings.

``outbox-relay`` reads the ``database`` and ``broker`` groups plus these, never the worker's;
its maintenance commands (``status``, ``requeue``, ``cleanup``) read only ``database`` and
``outbox``. Durations are in seconds. (The relay package re-exports these classes from
``consumer_kit.outbox_relay.settings``; they live here so the one settings tree can list them.)
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from consumer_kit.settings.listen_address import check_host, listen_host

from .broker import BrokerSettings
from .database import DatabaseSettings
from .fields import count, example, seconds


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


class OutboxSettings(DatabaseSettings):
    """The outbox's own rules, shared by the relay and its maintenance commands (``outbox-relay
    status``, ``requeue``, ``cleanup``, which read nothing else: a bad worker setting cannot break
    them). Durations in seconds; every number has an enforced range.

    Raises (on construction):
        pydantic.ValidationError: a value out of range, or settings that contradict each other.
    """

    relay_id: str = Field(
        default_factory=default_relay_id,
        description="Name of this relay, written to claimed_by. Default: <host>:<pid>:<4 hex>.",
    )
    relay_max_attempts: int = count(
        20, unit="attempts", minimum=1, maximum=10_000, example=20,
        description="Failed publishes before a row is parked (never deleted).",
    )
    relay_claim_timeout: float = seconds(
        60.0, minimum=1, maximum=3600, example=60,
        description="Claim lease: another relay takes rows over after it. A batch publishes for at"
        " most 80 % of it, which must leave room for a publish confirm: at least"
        " 1.25 x SETTLE_TIMEOUT.",
    )
    relay_backoff_base: float = seconds(
        1.0, minimum=0.05, maximum=3600, example=1,
        description="First retry delay after a failed publish; doubles per attempt.",
    )
    relay_backoff_max: float = seconds(
        300.0, minimum=0.05, maximum=86_400, example=300,
        description="Longest retry delay; at least RELAY_BACKOFF_BASE.",
    )
    relay_retention: float = seconds(
        7 * 24 * 3600.0, minimum=0, maximum=366 * 24 * 3600, example=604800,
        description="Keep published rows this long (0: delete them at the next cleanup).",
    )
    relay_cleanup_batch: int = count(
        1000, unit="rows", minimum=1, maximum=100_000, example=1000,
        description="Rows deleted per statement of a cleanup pass (short statements, no table rewrite).",
    )

    @model_validator(mode="after")
    def _backoff_range(self) -> Self:
        if self.relay_backoff_max < self.relay_backoff_base:
            raise ValueError(
                f"CONSUMER_KIT_RELAY_BACKOFF_MAX={self.relay_backoff_max:g} must be at least"
                f" CONSUMER_KIT_RELAY_BACKOFF_BASE={self.relay_backoff_base:g} (seconds, e.g. 300 and 1)"
            )
        return self


class RelaySettings(BrokerSettings, OutboxSettings):
    """Settings of ``outbox-relay``: the ``database`` and ``broker`` groups (the publisher reads
    ``BROKER_URL`` and ``SETTLE_TIMEOUT``, its confirm timeout) plus ``CONSUMER_KIT_RELAY_*``.
    Durations are in seconds; each number has a range, stated in its description and enforced.

    Raises (on construction):
        pydantic.ValidationError: a value out of range, or settings that contradict each other.
    """

    relay_batch_size: int = count(
        200, unit="rows", minimum=1, maximum=10_000, example=200, description="Rows claimed per batch."
    )
    relay_max_in_flight: int = count(
        256, unit="publishes", minimum=1, maximum=10_000, example=256,
        description="Unconfirmed publishes at once.",
    )
    relay_poll_interval: float = seconds(
        2.0, minimum=0.05, maximum=3600, example=2,
        description="Fallback poll when no NOTIFY arrives (lost, missed, or OUTBOX_NOTIFY=false);"
        " each poll is a claim query, hence the floor.",
    )
    relay_listen_url: str | None = example(
        "postgresql://user:password@db.example:5432/app",
        "Where the relay LISTENs for the outbox's NOTIFY: a direct PostgreSQL URL (LISTEN does not"
        " work through a transaction-mode pooler), or 'off' to poll only. Unset: DATABASE_URL,"
        " or polling every RELAY_POLL_INTERVAL when DATABASE_POOLER=transaction. Shown at start.",
    )
    relay_ordered: bool = example(
        "true", "Publish rows of one partition key one at a time in commit order.",
        default=True, rule="must be true or false",
    )
    relay_destinations: Annotated[dict[str, RouteTarget] | None, NoDecode] = example(
        '{"billing.events": {"exchange": "billing"}}',
        "Destination map (JSON). Unset: destination = exchange of that name.",
        rule='must be a JSON object of destination -> {"exchange": ..., "routing_key": ...}',
    )
    relay_destinations_file: Path | None = Field(
        default=None, description="TOML or JSON file with a [destinations] table."
    )
    relay_health_file: Path | None = Field(default=None, description="File touched on every loop of the relay.")
    relay_health_port: int | None = count(
        None, unit="TCP port", minimum=0, maximum=65_535, example=8082,
        description="Tiny HTTP health endpoint on RELAY_HEALTH_HOST (0: any free port).",
    )
    relay_health_host: str = listen_host(
        "127.0.0.1",
        "Address the relay's health endpoint listens on. Default 127.0.0.1 (not exposed unless"
        " asked); 0.0.0.0 (or ::) for Kubernetes probes.",
    )

    @field_validator("relay_health_host")
    @classmethod
    def _health_host(cls, value: str) -> str:
        return check_host(value)

    @field_validator("relay_destinations", mode="before")
    @classmethod
    def _parse_destinations(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError("not JSON") from None
        return value

    @model_validator(mode="after")
    def _lease_leaves_room_for_a_confirm(self) -> Self:
        if self.publish_deadline < self.settle_timeout:
            raise ValueError(
                f"CONSUMER_KIT_RELAY_CLAIM_TIMEOUT={self.relay_claim_timeout:g} must be at least"
                f" 1.25 x CONSUMER_KIT_SETTLE_TIMEOUT={self.settle_timeout:g} (seconds): a batch"
                " publishes for 80 % of the claim lease, which must leave time for a publish"
                " confirm, else rows never publish and never park (e.g. 60 with 10)"
            )
        return self

    @property
    def publish_deadline(self) -> float:
        """Seconds a batch may spend publishing: 80 % of the claim lease, so this relay has
        stopped publishing a row before another relay may take it over."""
        return self.relay_claim_timeout * 0.8
