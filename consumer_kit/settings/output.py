"""The ``logging`` group (what every command-line program shares: its logs and progress bars) and
the ``telemetry`` group (metrics and traces of the long-running ones: the worker and the relay).
A command-line option (``--log-level``, ``--metrics-port``, ...) wins over the variable.
"""

from __future__ import annotations

from pydantic import field_validator

from consumer_kit.settings.listen_address import check_host, listen_host

from .fields import GroupSettings, count, example, seconds

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
_LEVEL_RULE = f"must be one of {', '.join(LEVELS)}"
_FORMAT_RULE = f"must be one of {', '.join(LOG_FORMATS)}"


class LoggingSettings(GroupSettings):
    """Logs and progress bars of every ``consumer-kit`` and ``outbox-relay`` command.

    Raises (on construction):
        pydantic.ValidationError: a value out of range or not one of the allowed words.
    """

    log_level: str = example(
        "INFO", "Level of consumer-kit's own logs (consumer_kit.*): DEBUG shows every delivery."
        " Default: INFO (WARNING for the one-shot commands).",
        default="INFO", rule=_LEVEL_RULE,
    )
    library_log_level: str = example(
        "WARNING", "Level of other libraries' logs (aio-pika, aiormq, psycopg, ...).",
        default="WARNING", rule=_LEVEL_RULE,
    )
    log_format: str = example(
        "json", "text (one line per record) or json (one JSON object per record).",
        default="text", rule=_FORMAT_RULE,
    )
    progress: bool = example(
        "true", "Show progress bars (dlq redrive) even when stderr is not a terminal.",
        default=False, rule="must be true or false",
    )

    @field_validator("log_level", "library_log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.upper() not in LEVELS:
            raise ValueError(_LEVEL_RULE)
        return value.upper()

    @field_validator("log_format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value.lower() not in LOG_FORMATS:
            raise ValueError(_FORMAT_RULE)
        return value.lower()


class TelemetrySettings(GroupSettings):
    """Metrics and traces of ``consumer-kit worker`` and ``outbox-relay`` (the one-shot commands
    read none of it, so a bad metrics setting cannot break ``migrate``).

    Raises (on construction):
        pydantic.ValidationError: a value out of range.
    """

    metrics_port: int | None = count(
        None, unit="TCP port", minimum=1, maximum=65_535, example=9464,
        description="Serve metrics in Prometheus format at http://METRICS_HOST:PORT/metrics"
        " (needs the otel extra). Unset: no metrics endpoint.",
    )
    metrics_host: str = listen_host(
        "0.0.0.0",
        "Address the Prometheus endpoint listens on. Default 0.0.0.0: a scraper runs on another"
        " host or pod, and metrics are served only when a port is asked for; they carry counts and"
        " names, never payloads. 127.0.0.1 keeps them on the host.",
    )
    metrics_port_range: int = count(
        1, unit="ports", minimum=1, maximum=1024, example=4,
        description="How many ports from METRICS_PORT this process may take; set by the supervisor"
        " of `consumer-kit worker --processes N` for its children, not by hand.",
    )
    metrics_interval: float = seconds(
        15.0, minimum=0.1, maximum=3600, example=15,
        description="Time between refreshes of the database gauges (outbox backlog, ledger states)"
        " while metrics are exported.",
    )
    otel: bool = example(
        "true", "Export traces and metrics by OTLP, configured by the standard OTEL_* variables"
        " (needs the otel extra).", default=False, rule="must be true or false",
    )

    @field_validator("metrics_host")
    @classmethod
    def _host(cls, value: str) -> str:
        return check_host(value)
