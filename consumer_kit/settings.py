"""Configuration, read from the environment with prefix ``CONSUMER_KIT_`` (pydantic-settings).

Two classes, so that a command reads only what it uses:

* :class:`DatabaseSettings`: where the ledger and the outbox live (``DATABASE_URL``,
  ``DB_SCHEMA``, ``EMBEDDED_DATA_DIR``). ``consumer-kit migrate`` needs nothing else, so a bad
  worker setting cannot break it.
* :class:`Settings` (extends it): everything a worker uses. The relay's ``RelaySettings``
  extends :class:`Settings`.

Every number has a documented, enforced range (finite, a floor that keeps the system sane, a
ceiling), checked when the settings are read. :meth:`DatabaseSettings.from_environment` turns a
refusal into one line per setting that names the variable, the unit, the range and an example::

    CONSUMER_KIT_LOCK_TIMEOUT=0.0004: seconds, must be between 0.001 and 3600 (e.g. 5)
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Self

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic.config import JsonDict
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from consumer_kit.errors import ConfigurationError
from consumer_kit.listen_address import check_host, listen_host
from consumer_kit.redaction import redact_url

ENV_PREFIX = "CONSUMER_KIT_"
EMBEDDED = "embedded"
"""``CONSUMER_KIT_DATABASE_URL=embedded``: use the embedded PostgreSQL (pgserver), on purpose."""

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_RETRY_DELAY_MAX = 43_200.0  # seconds: 12 h, SQS's longest visibility timeout, so every broker can
_RETRY_TIERS_MAX = 20  # each distinct delay is a retry queue on RabbitMQ
_DELAYS_RULE = (
    f"seconds each, a JSON list or comma-separated, 1 to {_RETRY_TIERS_MAX} values between 0 and"
    f" {_RETRY_DELAY_MAX:g}"
)


def number(value: float) -> str:
    """``5``, ``0.001``, ``31622400``: a range bound as a user types it (no exponent)."""
    return f"{value:.0f}" if value == int(value) else f"{value:g}"


def seconds(
    default: float | None, *, minimum: float, maximum: float, example: float | str, description: str
) -> Any:
    """A duration field in seconds: finite, ``minimum <= value <= maximum``; the range and an
    example are appended to ``description`` and kept for error messages."""
    return Field(
        default=default, ge=minimum, le=maximum, allow_inf_nan=False,
        description=f"{description} Seconds, {number(minimum)} to {number(maximum)} (e.g. {example}).",
        json_schema_extra={"unit": "seconds", "minimum": minimum, "maximum": maximum, "example": str(example)},
    )


def count(
    default: int | None, *, unit: str, minimum: int, maximum: int, example: int | str, description: str
) -> Any:
    """An integer field of ``unit`` (deliveries, rows, ...) within ``minimum..maximum``."""
    return Field(
        default=default, ge=minimum, le=maximum,
        description=f"{description} {unit.capitalize()}, {minimum} to {maximum} (e.g. {example}).",
        json_schema_extra={"unit": unit, "minimum": minimum, "maximum": maximum, "example": str(example)},
    )


def example(value: str, description: str, default: Any = None, *, rule: str | None = None) -> Any:
    """A field without a numeric range, with an ``example`` (and the ``rule`` to state instead of
    pydantic's own message) for error messages."""
    extra: JsonDict = {"example": value} if rule is None else {"example": value, "rule": rule}
    return Field(default=default, description=description, json_schema_extra=extra)


class DatabaseSettings(BaseSettings):
    """Where the ledger and the outbox live: all that ``consumer-kit migrate`` reads.

    Every field is an environment variable, e.g. ``CONSUMER_KIT_DATABASE_URL``.

    Raises (on construction):
        pydantic.ValidationError: a value out of range (:meth:`from_environment` says it in
            one line per setting instead).
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=None, extra="ignore")

    database_url: str | None = example(
        "postgresql://user:password@db.example:5432/app",
        "PostgreSQL URL, or 'embedded' for an embedded PostgreSQL (pgserver) under"
        " embedded_data_dir. Unset: the worker, the relay and migrate refuse to start, so a"
        " forgotten URL never puts real messages into a throwaway database; in-process runs"
        " (the demo, tests with memory://) use the embedded one.",
    )
    db_schema: str = example("consumer_kit", "Schema of the ledger and outbox.", default="consumer_kit")
    embedded_data_dir: Path = Field(
        default=Path(".consumer-kit/pgdata"), description="Data directory of the embedded PostgreSQL."
    )
    mark_key: SecretStr | None = Field(
        default=None, min_length=16,
        description="Key (at least 16 characters) that signs consumer-kit's marks on the copies it sends."
        " Unset: the random key `consumer-kit migrate` keeps in the schema's mark_keys table.",
    )
    mark_key_previous: SecretStr | None = Field(
        default=None, min_length=16,
        description="While rotating mark_key: the previous key, still accepted on marks (never signs).",
    )

    @field_validator("db_schema")
    @classmethod
    def _schema_is_identifier(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError("must be a plain SQL identifier (letters, digits, _; <= 63 chars)")
        return value

    @property
    def embedded(self) -> bool:
        """True when ``database_url`` is ``embedded`` (asked for) or unset (in-process runs)."""
        return self.database_url is None or self.database_url.strip().lower() == EMBEDDED

    @classmethod
    def from_environment(cls, *, options: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Read the environment; ``overrides`` (``None`` values skipped) win over it.

        Args:
            options: field -> command-line option that set it (``{"relay_claim_timeout":
                "--claim-timeout"}``), so an error names what the user typed.

        Raises:
            ConfigurationError: one line per refused setting: the variable (or option), its
                value, the unit, the allowed range and an example.
        """
        given = {name: value for name, value in overrides.items() if value is not None}
        try:
            return cls(**given)
        except ValidationError as exc:
            lines = [cls._describe(error, given, options or {}) for error in exc.errors()]
        except SettingsError as exc:  # a value pydantic-settings could not even parse
            lines = [str(exc)]
        raise ConfigurationError("\n".join(dict.fromkeys(lines)))

    @classmethod
    def _describe(
        cls, error: Mapping[str, Any], given: Mapping[str, Any], options: Mapping[str, str]
    ) -> str:
        """One line for one pydantic error (see :meth:`from_environment`)."""
        if not error["loc"]:  # a rule across settings: its message names the variables
            return str(error["msg"]).removeprefix("Value error, ")
        name = str(error["loc"][0])
        field = cls.model_fields.get(name)
        if name in given:
            source, value = options.get(name, name), given[name]
        else:
            source, value = env_name(name), _environ(env_name(name), error.get("input"))
        if name.endswith("_url"):  # never a password in an error
            value = redact_url(value) if isinstance(value, str) else "***"
        if name.startswith("mark_key"):  # nor a key
            value = "***"
        extra = field.json_schema_extra if field is not None else None
        info: Mapping[str, Any] = extra if isinstance(extra, Mapping) else {}
        shown = value if isinstance(value, str) else json.dumps(value, default=str)
        if "minimum" in info:
            rule = (
                f"{info['unit']}, must be between {number(info['minimum'])} and {number(info['maximum'])}"
                f" (e.g. {info['example']})"
            )
            return f"{source}={shown}: {rule}"
        reason = info.get("rule") or str(error["msg"]).removeprefix("Value error, ")
        hint = f" (e.g. {info['example']})" if "example" in info else ""
        return f"{source}={shown}: {reason}{hint}"


def env_name(field: str) -> str:
    """``lock_timeout`` -> ``CONSUMER_KIT_LOCK_TIMEOUT``."""
    return ENV_PREFIX + field.upper()


def _environ(name: str, fallback: Any) -> Any:
    """The raw environment value of ``name`` (matched without case, as pydantic-settings does)."""
    for key, value in os.environ.items():
        if key.upper() == name:
            return value
    return fallback


class Settings(DatabaseSettings):
    """Worker settings (the relay's extend them).

    Every field can be set as an environment variable, e.g. ``CONSUMER_KIT_LOCK_TIMEOUT``.
    Durations are in seconds; each has a range, stated in its description and enforced.

    Raises (on construction):
        pydantic.ValidationError: a value out of range, or settings that contradict each other.
    """

    broker_url: str = example(
        "amqp://guest:guest@127.0.0.1:5672/", "amqp://... or memory://", default="memory://"
    )
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
        json_schema_extra={"rule": _DELAYS_RULE, "example": "1,5,30"},
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
    settle_timeout: float = seconds(
        10.0, minimum=0.1, maximum=300, example=10,
        description="Longest wait on a settlement (ack, retry, dead-letter) and on a publish confirm.",
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
    metrics_host: str = listen_host(
        "0.0.0.0",
        "Address the Prometheus endpoint (--metrics-port) listens on. Default 0.0.0.0: a scraper"
        " runs on another host or pod, and metrics are served only when a port is asked for; they"
        " carry counts and names, never payloads. 127.0.0.1 keeps them on the host.",
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

    @field_validator("health_host", "metrics_host")
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
        return self.prefetch or self.concurrency

    @property
    def effective_idle_in_transaction_timeout(self) -> float:
        """Seconds a session of consumer-kit's may sit idle inside a transaction
        (``idle_in_transaction_timeout``, else ``handler_timeout + statement_timeout``)."""
        return self.idle_in_transaction_timeout or self.handler_timeout + self.statement_timeout

    @model_validator(mode="after")
    def _idle_bound_covers_the_handler(self) -> Settings:
        bound = self.idle_in_transaction_timeout
        if bound is not None and bound < self.handler_timeout:
            raise ValueError(
                f"idle_in_transaction_timeout ({bound:g} s) must not be below handler_timeout "
                f"({self.handler_timeout:g} s): a handler waiting inside its transaction would lose "
                "its session mid-run"
            )
        return self



def unknown_variables(known: set[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """``CONSUMER_KIT_*`` variables that look like a misspelt setting, each as
    ``"CONSUMER_KIT_LOCK_TIMOUT (did you mean CONSUMER_KIT_LOCK_TIMEOUT?)"``. Variables with no
    close match are left alone (tests and tools use the prefix for their own variables)."""
    names = {env_name(field) for field in known}
    found = []
    for key in sorted(environ if environ is not None else os.environ):
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or upper in names:
            continue
        match = difflib.get_close_matches(upper, names, n=1, cutoff=0.95)
        if match:
            found.append(f"{key} (did you mean {match[0]}?)")
    return found
