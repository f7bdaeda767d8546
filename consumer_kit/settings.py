"""Configuration, read from the environment with prefix ``CONSUMER_KIT_`` (pydantic-settings)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class Settings(BaseSettings):
    """Worker and relay settings.

    Every field can be set as an environment variable, e.g. ``CONSUMER_KIT_DATABASE_URL``.
    Durations are in seconds.
    """

    model_config = SettingsConfigDict(env_prefix="CONSUMER_KIT_", env_file=None, extra="ignore")

    database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL. Unset: an embedded PostgreSQL (pgserver) under embedded_data_dir.",
    )
    broker_url: str = Field(default="memory://", description="amqp://... or memory://")
    db_schema: str = Field(default="consumer_kit", description="Schema of the ledger and outbox.")
    search_path: str | None = Field(
        default=None,
        description="PostgreSQL search_path for handler connections, e.g. 'app,public'.",
    )
    embedded_data_dir: Path = Field(default=Path(".consumer-kit/pgdata"))

    concurrency: int = Field(
        default=8, ge=1, le=1024,
        description="Deliveries processed at once per worker process, across all its queues.",
    )
    prefetch: int | None = Field(
        default=None, ge=1, le=10000,
        description="Deliveries each queue may hand out ahead (unacked, waiting for a slot)."
        " Default: concurrency.",
    )
    pool_size: int | None = Field(default=None, ge=1, description="Default: concurrency + 2.")
    max_deliveries: int = Field(
        default=5, ge=1,
        description="Dead-letter after this many handler faults of one operation (consumer-kit's own"
        " count in the ledger; outages, crashes, shutdowns and contention do not count).",
    )
    max_contentions: int = Field(
        default=20, ge=1,
        description="Dead-letter after this many contended attempts (lock timeout, deadlock,"
        " serialization failure) of one operation.",
    )
    crash_limit: int = Field(
        default=3, ge=1,
        description="Park a redelivered message as crashed_worker after the process died this many"
        " times while it ran alone.",
    )
    retry_delays: list[float] = Field(
        default=[1.0, 5.0, 30.0], description="Backoff per retry (seconds); the last one repeats."
    )
    in_progress_delay: float = Field(default=2.0, ge=0, description="Retry delay on in_progress.")
    lock_timeout: float = Field(
        default=5.0, gt=0, description="Longest wait on a concurrent claimer's row lock."
    )
    lease_seconds: float = Field(default=300.0, gt=0, description="Lease of a processing row.")
    handler_timeout: float = Field(default=60.0, gt=0, description="Longest handler run.")
    settle_timeout: float = Field(default=10.0, gt=0, description="Longest wait on a settlement.")
    statement_timeout: float = Field(
        default=10.0, gt=0,
        description="Longest wait for a statement of consumer-kit's own (claim after its lock wait,"
        " completion, COMMIT, attempt bookkeeping) and for a pooled connection; past it the"
        " database counts as unavailable and the connection is discarded.",
    )
    probe_backoff_max: float = Field(
        default=15.0, gt=0,
        description="Longest pause between probes of an unavailable database while paused.",
    )
    health_file: Path | None = Field(
        default=None, description="File touched every second while the worker's loop is alive.",
    )
    health_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="Serve /live and /ready on 127.0.0.1:PORT (0: any free port).",
    )
    shutdown_timeout: float = Field(default=30.0, gt=0, description="Longest wait for in-flight work.")
    outbox_notify: bool = Field(
        default=True,
        description="NOTIFY the relay on each transaction that writes outbox rows. Off: the relay"
        " polls (set CONSUMER_KIT_RELAY_POLL_INTERVAL low); commits no longer serialise on NOTIFY.",
    )
    summary_interval: float = Field(
        default=10.0, gt=0, description="Seconds between the worker's INFO lines of outcome counts."
    )

    @field_validator("db_schema")
    @classmethod
    def _schema_is_identifier(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError("must be a plain SQL identifier (letters, digits, _; <= 63 chars)")
        return value

    @field_validator("retry_delays")
    @classmethod
    def _delays_non_empty(cls, value: list[float]) -> list[float]:
        if not value or any(d < 0 for d in value):
            raise ValueError("needs at least one delay, all >= 0 seconds")
        return value

    def retry_delay(self, delivery_count: int) -> float:
        """Backoff before the next delivery, given this delivery's count (1-based)."""
        index = min(max(delivery_count, 1) - 1, len(self.retry_delays) - 1)
        return self.retry_delays[index]

    @property
    def effective_pool_size(self) -> int:
        """Connections in the pool: one per delivery slot plus two for the bookkeeping that runs
        after a delivery's own connection went back (a smaller pool would make deliveries wait)."""
        return self.pool_size or self.concurrency + 2

    @property
    def effective_prefetch(self) -> int:
        return self.prefetch or self.concurrency


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs and error messages)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparsable URL>"
    if password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{password}@", ":***@", 1)))
