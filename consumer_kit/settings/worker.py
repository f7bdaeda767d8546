"""The ``worker`` group: how ``consumer-kit worker`` runs deliveries (concurrency, attempts, retry
delays, timeouts, health). Every duration is in seconds with an enforced range.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from consumer_kit.settings.listen_address import check_host, listen_host

from .broker import BrokerSettings
from .fields import count, example, seconds

_RETRY_DELAY_MAX = 43_200.0  # seconds: 12 h, SQS's longest visibility timeout, so every broker can
_RETRY_TIERS_MAX = 20  # each distinct delay is a retry queue on RabbitMQ
_DELAYS_RULE = (
    f"seconds each, a JSON list or comma-separated, 1 to {_RETRY_TIERS_MAX} values between 0 and"
    f" {_RETRY_DELAY_MAX:g}"
)


class WorkerSettings(BrokerSettings):
    """The ``worker`` group: what ``consumer-kit worker`` (and the HTTP front door) read, on top of
    :class:`BrokerSettings` (and so :class:`DatabaseSettings`).

    Every field can be set as an environment variable, e.g. ``CONSUMER_KIT_LOCK_TIMEOUT``.
    Durations are in seconds; each has a range, stated in its description and enforced.

    Raises (on construction):
        pydantic.ValidationError: a value out of range, or settings that contradict each other.
    """

    search_path: str | None = example(
        "app,public", "PostgreSQL search_path for handler connections."
    )

    concurrency: int = count(
        8, unit="deliveries", minimum=1, maximum=1024, example=8,
        description="Deliveries processed at once per worker process, across all its queues.",
    )
    prefetch: int | None = count(
        None, unit="deliveries", minimum=1, maximum=10_000, example=16,
        description="Deliveries each queue may hand out ahead (unacked, waiting for a slot)."
        " Default: concurrency.",
    )
    pool_size: int | None = count(
        None, unit="connections", minimum=1, maximum=1024, example=10,
        description="PostgreSQL connections of one worker process. Default: concurrency + 2.",
    )
    max_deliveries: int = count(
        5, unit="attempts", minimum=1, maximum=1000, example=5,
        description="Dead-letter after this many handler faults of one operation (consumer-kit's own"
        " count in the ledger; outages, crashes, shutdowns and contention do not count).",
    )
    max_contentions: int = count(
        20, unit="attempts", minimum=1, maximum=10_000, example=20,
        description="Dead-letter after this many contended attempts (lock timeout, deadlock,"
        " serialization failure) of one operation.",
    )
    crash_limit: int = count(
        3, unit="crashes", minimum=1, maximum=100, example=3,
        description="Park a redelivered message as crashed_worker after the process died this many"
        " times while it ran alone.",
    )
    alone_marker_ttl: float = seconds(
        5.0, minimum=1, maximum=300, example=5,
        description="How long a run alone's marker outlives its last renewal (renewed every fifth of"
        " it): a crash is counted once a dead run's marker has expired, so a redelivery arriving"
        " sooner waits (in_progress); shorter detects crashes sooner, but a database outage longer"
        " than it during a run alone counts as a crash.",
    )
    retry_delays: Annotated[list[float], NoDecode] = Field(
        default=[1.0, 5.0, 30.0],
        description="Backoff per retry after a handler fault; the last one repeats:"
        f" {_DELAYS_RULE} (e.g. 1,5,30 or [1, 5, 30]). RabbitMQ: one retry queue per distinct delay.",
        json_schema_extra={
            "rule": _DELAYS_RULE, "example": "1,5,30", "unit": "seconds",
            "range": f"1 to {_RETRY_TIERS_MAX} values, each 0 to {_RETRY_DELAY_MAX:g}",
        },
    )
    in_progress_delay: float = seconds(
        2.0, minimum=0.05, maximum=3600, example=2,
        description="Retry delay when another worker holds the operation (in_progress), and the"
        " base of the jittered delay after contention. Never 0: the message would come straight"
        " back and re-claim in a hot loop.",
    )
    lock_timeout: float = seconds(
        5.0, minimum=0.001, maximum=3600, example=5,
        description="Longest wait on a lock: a concurrent claimer of the same key (then"
        " in_progress), a business row (then contention). PostgreSQL counts milliseconds and"
        " reads 0 as 'no limit', hence the floor of 1 ms.",
    )
    lease_seconds: float = seconds(
        300.0, minimum=1, maximum=86_400, example=300,
        description="Lease of a processing row (the external-effects path), renewed every third of"
        " it while the handler runs; a worker that dies holds it this long at most before another"
        " takes it over and reconciles.",
    )
    handler_timeout: float = seconds(
        60.0, minimum=0.1, maximum=86_400, example=60,
        description="Longest handler run; past it the handler is cancelled (a retryable fault).",
    )
    statement_timeout: float = seconds(
        10.0, minimum=0.5, maximum=3600, example=10,
        description="Longest wait for a statement of consumer-kit's own (claim after its lock wait,"
        " completion, COMMIT, attempt bookkeeping) and for a pooled connection; past it the"
        " database counts as unavailable and the connection is discarded.",
    )
    idle_in_transaction_timeout: float | None = seconds(
        None, minimum=1, maximum=86_400, example=70,
        description="PostgreSQL's idle_in_transaction_session_timeout on consumer-kit's own"
        " sessions: a process frozen (SIGSTOP, a paused VM) inside a delivery's transaction loses"
        " its session after this long, so its claim's row lock is freed and another worker runs the"
        " operation; the frozen one's transaction is rolled back. Default: handler_timeout +"
        " statement_timeout, the longest a handler may wait inside its transaction; never below"
        " handler_timeout.",
    )
    probe_backoff_max: float = seconds(
        15.0, minimum=0.5, maximum=3600, example=15,
        description="Longest pause between probes of an unavailable database while paused"
        " (probes start 0.5 s apart and double).",
    )
    health_file: Path | None = Field(
        default=None, description="File touched every second while the worker's loop is alive.",
    )
    health_port: int | None = count(
        None, unit="TCP port", minimum=0, maximum=65_535, example=8081,
        description="Serve /live and /ready on HEALTH_HOST:PORT (0: any free port).",
    )
    health_host: str = listen_host(
        "127.0.0.1",
        "Address the health endpoint listens on. Default 127.0.0.1: its answers (counters, state)"
        " stay on the host unless asked; set 0.0.0.0 (or ::) for Kubernetes probes, which connect"
        " to the pod's IP.",
    )
    shutdown_timeout: float = seconds(
        30.0, minimum=0.1, maximum=3600, example=30,
        description="On SIGTERM, longest wait for in-flight deliveries before giving them back.",
    )
    outbox_notify: bool = example(
        "false",
        "NOTIFY the relay on each transaction that writes outbox rows. Off: the relay"
        " polls (set CONSUMER_KIT_RELAY_POLL_INTERVAL low); commits no longer serialise on NOTIFY.",
        default=True, rule="must be true or false",
    )
    summary_interval: float = seconds(
        10.0, minimum=1, maximum=86_400, example=10,
        description="Time between the worker's INFO lines of outcome counts.",
    )

    @field_validator("health_host")
    @classmethod
    def _host(cls, value: str) -> str:
        return check_host(value)

    @field_validator("retry_delays", mode="before")
    @classmethod
    def _parse_delays(cls, value: Any) -> Any:
        """Accept a JSON list (``[1, 5, 30]``) or comma-separated seconds (``1,5,30``)."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(_DELAYS_RULE) from None
        return [part.strip() for part in text.split(",")]

    @field_validator("retry_delays")
    @classmethod
    def _delays_in_range(cls, value: list[float]) -> list[float]:
        if not 1 <= len(value) <= _RETRY_TIERS_MAX:
            raise ValueError(_DELAYS_RULE)
        if any(not 0 <= delay <= _RETRY_DELAY_MAX for delay in value):  # also NaN
            raise ValueError(_DELAYS_RULE)
        return value

    def retry_delay(self, delivery_count: int) -> float:
        """Backoff in seconds before the next delivery, given this delivery's count (1-based)."""
        index = min(max(delivery_count, 1) - 1, len(self.retry_delays) - 1)
        return self.retry_delays[index]

    @property
    def effective_pool_size(self) -> int:
        """Connections in the pool: one per delivery slot plus two for the bookkeeping that runs
        after a delivery's own connection went back (a smaller pool would make deliveries wait)."""
        return self.pool_size or self.concurrency + 2

    @property
    def effective_prefetch(self) -> int:
        """Deliveries each queue hands out ahead: ``prefetch``, else ``concurrency``."""
        return self.prefetch or self.concurrency

    @property
    def effective_idle_in_transaction_timeout(self) -> float:
        """Seconds a session of consumer-kit's may sit idle inside a transaction
        (``idle_in_transaction_timeout``, else ``handler_timeout + statement_timeout``)."""
        return self.idle_in_transaction_timeout or self.handler_timeout + self.statement_timeout

    @model_validator(mode="after")
    def _idle_bound_covers_the_handler(self) -> WorkerSettings:
        bound = self.idle_in_transaction_timeout
        if bound is not None and bound < self.handler_timeout:
            raise ValueError(
                f"idle_in_transaction_timeout ({bound:g} s) must not be below handler_timeout "
                f"({self.handler_timeout:g} s): a handler waiting inside its transaction would lose "
                "its session mid-run"
            )
        return self


Settings = WorkerSettings
"""The worker's settings under their older name (``from consumer_kit.settings import Settings``)."""
