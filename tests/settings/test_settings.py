"""Settings that validate but mean something else are refused, each with one line that names the
variable, its unit, the allowed range and an example; commands read only what they use."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import pytest
import typer
from pydantic import BaseModel
from typer.testing import CliRunner

from consumer_kit import Context, Envelope, Handler, Result
from consumer_kit.cli.console import LogLevel, setup_logging
from consumer_kit.errors import ConfigurationError
from consumer_kit.outbox_relay.settings import OutboxSettings, RelaySettings
from consumer_kit.settings import (
    SETTINGS_GROUPS,
    DatabaseSettings,
    GroupSettings,
    Settings,
    WorkerSettings,
    number,
    own_fields,
    unknown_variables,
)
from consumer_kit.testing import Harness


class _Cmd(BaseModel):
    n: int


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CONSUMER_KIT_* variable of the caller's shell leaks into these tests."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("CONSUMER_KIT_"):
            monkeypatch.delenv(name)


def bounded_fields() -> list[tuple[type[GroupSettings], str, dict[str, Any]]]:
    """(group class, field, its range) of every bounded setting of the environment's groups."""
    found = []
    for group, cls in SETTINGS_GROUPS.items():
        if not issubclass(cls, GroupSettings):
            continue  # the sqs group: URL options (tests/test_sqs_config.py)
        for name in own_fields(group):
            extra = cls.model_fields[name].json_schema_extra
            if isinstance(extra, dict) and "minimum" in extra:
                found.append((cls, name, dict(extra)))
    return found


DURATIONS = [(c, n, i) for c, n, i in bounded_fields() if i["unit"] == "seconds"]
COUNTS = [(c, n, i) for c, n, i in bounded_fields() if i["unit"] != "seconds"]


def refusal(cls: type[GroupSettings], **env: str) -> str:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(ConfigurationError) as refused:
            cls.from_environment()
    return str(refused.value)


def test_every_duration_has_a_finite_range_with_a_floor_above_zero_where_zero_means_a_hot_loop() -> None:
    ranges = {name: (info["minimum"], info["maximum"]) for _, name, info in DURATIONS}
    assert ranges == {
        "in_progress_delay": (0.05, 3600), "lock_timeout": (0.001, 3600), "alone_marker_ttl": (1, 300),
        "lease_seconds": (1, 86_400), "handler_timeout": (0.1, 86_400),
        "settle_timeout": (0.1, 300), "statement_timeout": (0.5, 3600),
        "idle_in_transaction_timeout": (1, 86_400),
        "probe_backoff_max": (0.5, 3600), "shutdown_timeout": (0.1, 3600),
        "summary_interval": (1, 86_400), "relay_claim_timeout": (1, 3600),
        "relay_backoff_base": (0.05, 3600), "relay_backoff_max": (0.05, 86_400),
        "relay_retention": (0, 366 * 86_400), "relay_poll_interval": (0.05, 3600),
        "metrics_interval": (0.1, 3600), "receive_wait": (0.01, 60),
    }
    for cls, name, info in DURATIONS:  # the description a user reads states the same range
        assert f"Seconds, {number(info['minimum'])} to {number(info['maximum'])}" in cls.model_fields[name].description


@pytest.mark.parametrize("cls, name, info", DURATIONS, ids=[n for _, n, _ in DURATIONS])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "below", "above"])
def test_a_duration_out_of_range_is_refused_naming_variable_unit_range_and_example(
    cls: type[GroupSettings], name: str, info: dict[str, Any], value: str
) -> None:
    given = {"below": f"{info['minimum'] - 0.0001:g}" if info["minimum"] else "-1",
             "above": f"{info['maximum'] * 2:g}"}.get(value, value)
    assert math.isnan(float(given)) or not info["minimum"] <= float(given) <= info["maximum"]
    line = refusal(cls, **{cls.env_name_of(name): given})
    assert line == (
        f"{cls.env_name_of(name)}={given}: seconds, must be between {number(info['minimum'])} and "
        f"{number(info['maximum'])} (e.g. {info['example']})"
    )


@pytest.mark.parametrize("cls, name, info", COUNTS, ids=[n for _, n, _ in COUNTS])
def test_a_count_out_of_range_is_refused_the_same_way(cls: type[GroupSettings], name: str, info: dict[str, Any]) -> None:
    for given in (str(info["minimum"] - 1), str(info["maximum"] + 1)):
        assert refusal(cls, **{cls.env_name_of(name): given}) == (
            f"{cls.env_name_of(name)}={given}: {info['unit']}, must be between {info['minimum']} and "
            f"{info['maximum']} (e.g. {info['example']})"
        )


def test_the_reported_lock_timeout_that_meant_no_limit_is_refused() -> None:
    assert refusal(Settings, CONSUMER_KIT_LOCK_TIMEOUT="0.0004") == (
        "CONSUMER_KIT_LOCK_TIMEOUT=0.0004: seconds, must be between 0.001 and 3600 (e.g. 5)"
    )
    assert Settings(lock_timeout=0.001).lock_timeout == 0.001  # the floor itself is allowed


def test_the_reported_hot_loop_values_are_refused() -> None:
    assert refusal(Settings, CONSUMER_KIT_IN_PROGRESS_DELAY="0").startswith(
        "CONSUMER_KIT_IN_PROGRESS_DELAY=0: seconds, must be between 0.05 and 3600"
    )
    assert refusal(RelaySettings, CONSUMER_KIT_RELAY_POLL_INTERVAL="1e-6").startswith(
        "CONSUMER_KIT_RELAY_POLL_INTERVAL=1e-6: seconds, must be between 0.05 and 3600"
    )
    assert refusal(RelaySettings, CONSUMER_KIT_RELAY_CLAIM_TIMEOUT="0.001").startswith(
        "CONSUMER_KIT_RELAY_CLAIM_TIMEOUT=0.001: seconds, must be between 1 and 3600"
    )


def test_every_refused_setting_gets_its_own_line() -> None:
    lines = refusal(
        Settings, CONSUMER_KIT_LOCK_TIMEOUT="0", CONSUMER_KIT_CONCURRENCY="0",
        CONSUMER_KIT_OUTBOX_NOTIFY="maybe",
    ).splitlines()
    assert lines == [
        "CONSUMER_KIT_CONCURRENCY=0: deliveries, must be between 1 and 1024 (e.g. 8)",
        "CONSUMER_KIT_LOCK_TIMEOUT=0: seconds, must be between 0.001 and 3600 (e.g. 5)",
        "CONSUMER_KIT_OUTBOX_NOTIFY=maybe: must be true or false (e.g. false)",
    ]


@pytest.mark.parametrize("given, delays", [
    ("1,5", [1.0, 5.0]), (" 1 , 5 ,30 ", [1.0, 5.0, 30.0]), ("[1, 5]", [1.0, 5.0]), ("0", [0.0]),
    ("0.01,43200", [0.01, 43_200.0]),
])
def test_retry_delays_accept_a_comma_separated_list_or_json(
    monkeypatch: pytest.MonkeyPatch, given: str, delays: list[float]
) -> None:
    monkeypatch.setenv("CONSUMER_KIT_RETRY_DELAYS", given)
    assert Settings.from_environment().retry_delays == delays


@pytest.mark.parametrize("given", [
    "1,x", "1;5", "", "[1", "[1, NaN]", "[Infinity]", "-1", "43201", ",".join(["1"] * 21),
])
def test_bad_retry_delays_name_the_variable_and_the_format(given: str) -> None:
    assert refusal(Settings, CONSUMER_KIT_RETRY_DELAYS=given) == (
        f"CONSUMER_KIT_RETRY_DELAYS={given}: seconds each, a JSON list or comma-separated, "
        "1 to 20 values between 0 and 43200 (e.g. 1,5,30)"
    )


def test_settings_that_contradict_each_other_are_refused_naming_both() -> None:
    assert refusal(RelaySettings, CONSUMER_KIT_RELAY_CLAIM_TIMEOUT="10").startswith(
        "CONSUMER_KIT_RELAY_CLAIM_TIMEOUT=10 must be at least 1.25 x CONSUMER_KIT_SETTLE_TIMEOUT=10"
    )
    assert refusal(OutboxSettings, CONSUMER_KIT_RELAY_BACKOFF_BASE="10", CONSUMER_KIT_RELAY_BACKOFF_MAX="5") == (
        "CONSUMER_KIT_RELAY_BACKOFF_MAX=5 must be at least CONSUMER_KIT_RELAY_BACKOFF_BASE=10 "
        "(seconds, e.g. 300 and 1)"
    )
    assert RelaySettings(relay_claim_timeout=12.5, settle_timeout=10).publish_deadline == 10


def test_a_bad_destination_map_says_the_expected_shape() -> None:
    assert refusal(RelaySettings, CONSUMER_KIT_RELAY_DESTINATIONS="{billing") == (
        'CONSUMER_KIT_RELAY_DESTINATIONS={billing: must be a JSON object of destination -> '
        '{"exchange": ..., "routing_key": ...} (e.g. {"billing.events": {"exchange": "billing"}})'
    )


def test_an_option_is_named_as_typed_and_a_url_never_shows_its_password() -> None:
    with pytest.raises(ConfigurationError) as refused:
        RelaySettings.from_environment(
            relay_claim_timeout=0.5, options={"relay_claim_timeout": "--claim-timeout"}
        )
    assert str(refused.value) == "--claim-timeout=0.5: seconds, must be between 1 and 3600 (e.g. 60)"
    with pytest.raises(ConfigurationError) as refused:
        Settings.from_environment(broker_url=["amqp://u:s3cret@h/"])  # not a string at all
    assert "s3cret" not in str(refused.value)


def test_each_command_reads_only_its_groups_so_a_bad_worker_setting_breaks_only_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CONSUMER_KIT_RETRY_DELAYS", "1;5")  # broke `consumer-kit migrate` before
    monkeypatch.setenv("CONSUMER_KIT_LOCK_TIMEOUT", "0")
    assert DatabaseSettings.from_environment(db_schema="s").db_schema == "s"
    assert OutboxSettings.from_environment().relay_max_attempts == 20
    assert RelaySettings.from_environment().relay_batch_size == 200  # the relay reads no worker setting
    assert not set(RelaySettings.model_fields) & set(own_fields("worker"))
    with pytest.raises(ConfigurationError):
        WorkerSettings.from_environment()
    monkeypatch.setenv("CONSUMER_KIT_RELAY_BATCH_SIZE", "0")  # and a bad relay setting breaks only the relay
    assert WorkerSettings.from_environment(lock_timeout=5, retry_delays=[1]).concurrency == 8
    with pytest.raises(ConfigurationError):
        RelaySettings.from_environment()


def test_a_misspelt_variable_is_named_with_the_setting_it_resembles() -> None:
    environ = {"CONSUMER_KIT_LOCK_TIMOUT": "5", "CONSUMER_KIT_DATABASE_URI": "x", "CONSUMER_KIT_LOCK_TIMEOUT": "5",
               "CONSUMER_KIT_TEST_DATABASE_URL": "x", "CONSUMER_KIT_LOG_LEVEL": "DEBUG", "OTHER": "1"}
    assert unknown_variables(set(Settings.model_fields), environ) == [
        "CONSUMER_KIT_DATABASE_URI (did you mean CONSUMER_KIT_DATABASE_URL?)",
        "CONSUMER_KIT_LOCK_TIMOUT (did you mean CONSUMER_KIT_LOCK_TIMEOUT?)",
    ]


# -- the command line ---------------------------------------------------------------------------


def test_the_worker_refuses_a_bad_setting_in_one_line_with_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, cli_logging: None
) -> None:
    from consumer_kit.cli.main import cli

    monkeypatch.setenv("CONSUMER_KIT_LOCK_TIMEOUT", "0.0004")
    result = CliRunner().invoke(cli, ["worker", "consumer_kit.demo.app:app"])
    assert result.exit_code == 2
    assert result.stderr == "error: CONSUMER_KIT_LOCK_TIMEOUT=0.0004: seconds, must be between 0.001 and 3600 (e.g. 5)\n"


def test_the_relay_names_the_option_that_was_out_of_range(cli_logging: None) -> None:
    from consumer_kit.outbox_relay.cli import app

    result = CliRunner().invoke(app, ["--poll-interval", "0.000001"])
    assert result.exit_code == 2
    assert result.stderr == "error: --poll-interval=1e-06: seconds, must be between 0.05 and 3600 (e.g. 2)\n"


def test_an_unknown_log_level_is_refused(cli_logging: None) -> None:
    from consumer_kit.cli.main import cli

    result = CliRunner().invoke(cli, ["migrate", "--log-level", "LOUD"])
    assert result.exit_code == 2
    assert result.stderr == "error: --log-level=LOUD: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (e.g. INFO)\n"


# -- the floors keep the loops they guard slow ---------------------------------------------------


HOLD = 0.6  # seconds


class _Slow(Handler[_Cmd]):
    """Holds its claim (the open transaction) for ``HOLD`` seconds."""

    operation_type = "settings.slow"

    def operation_key(self, message: _Cmd, envelope: Envelope) -> str:
        return f"k-{message.n}"

    async def handle(self, message: _Cmd, ctx: Context) -> Result:
        await asyncio.sleep(HOLD)
        return Result(status="ok")


@pytest.mark.postgres
async def test_waiting_behind_a_running_duplicate_at_the_floors_is_not_a_hot_loop(database_url: str) -> None:
    """At LOCK_TIMEOUT=0.001 and IN_PROGRESS_DELAY=0 a duplicate re-claimed ~300 times a second;
    at the floors (0.001 and 0.05) it comes back at most once per 50 ms."""
    async with Harness(_Slow(), database_url=database_url, lock_timeout=10.0,
                       pg_lock_timeout=0.001, in_progress_delay=0.05) as kit:
        await kit.deliver({"n": 1}, times=2, concurrently=True)
        outcomes = kit.outcomes()
    assert (outcomes["executed"], outcomes["duplicate"]) == (1, 1)
    assert 1 <= outcomes["in_progress"] <= HOLD / 0.05 + 2, outcomes


@pytest.mark.postgres
async def test_an_idle_relay_at_the_poll_floor_claims_at_most_twenty_times_a_second(database_url: str) -> None:
    """RELAY_POLL_INTERVAL=1e-6 made 18,832 empty claims in 4 s; the floor (0.05 s) allows ~20/s.
    Measured over 3 s, not 1 s: the "still polling" bound (half the floor's rate) then leaves 1.5 s,
    not 0.5 s, for the claims themselves and any stall of a loaded machine."""
    from consumer_kit.adapters.memory import MemoryBroker, MemoryPublisher
    from consumer_kit.outbox_relay.relay import Relay
    from tests.fixtures.harness import throwaway_schema

    idle = 3.0  # seconds
    async with throwaway_schema(database_url, example_tables=False) as schema:
        relay = Relay(RelaySettings(database_url=database_url, db_schema=schema, broker_url="memory://",
                                    relay_poll_interval=0.05), publisher=MemoryPublisher(MemoryBroker()))
        task = asyncio.create_task(relay.run())
        await asyncio.sleep(idle)  # the thing measured: what idle seconds cost
        relay.request_stop()
        await asyncio.wait_for(task, 10)
    assert idle * 10 <= relay.counters["empty_claims"] <= idle / 0.05 + 2, relay.counters.snapshot()


def test_the_log_level_variable_beats_the_commands_default_and_the_option_beats_both(
    monkeypatch: pytest.MonkeyPatch, cli_logging: None
) -> None:
    """CONSUMER_KIT_LOG_LEVEL is read by the console group (no longer by the option parser); a bad
    metrics variable (the telemetry group) does not break a command that exports no metrics."""
    probe = typer.Typer()

    @probe.command()
    def run(log_level: LogLevel = "WARNING") -> None:
        setup_logging(log_level)
        typer.echo(logging.getLevelName(logging.getLogger("consumer_kit").level))

    monkeypatch.setenv("CONSUMER_KIT_METRICS_PORT", "not-a-port")
    assert CliRunner().invoke(probe, []).stdout == "WARNING\n"  # the command's own default
    monkeypatch.setenv("CONSUMER_KIT_LOG_LEVEL", "debug")
    assert CliRunner().invoke(probe, []).stdout == "DEBUG\n"
    assert CliRunner().invoke(probe, ["--log-level", "ERROR"]).stdout == "ERROR\n"
    monkeypatch.setenv("CONSUMER_KIT_LOG_LEVEL", "LOUD")
    refused = CliRunner().invoke(probe, [])
    assert refused.exit_code == 2
    assert refused.stderr == (
        "error: CONSUMER_KIT_LOG_LEVEL=LOUD: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (e.g. INFO)\n"
    )
