"""Where the health and metrics endpoints listen: ``--health-host`` / ``--metrics-host`` (and
``CONSUMER_KIT_HEALTH_HOST``, ``CONSUMER_KIT_RELAY_HEALTH_HOST``, ``CONSUMER_KIT_METRICS_HOST``).
Health defaults to 127.0.0.1 (this host only), metrics to 0.0.0.0 (a scraper runs elsewhere); each
endpoint answers on the address asked for and only there (127.0.0.2 is loopback too on Linux, so
"only there" is seen without leaving the machine); a bad address is a clear configuration error."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import urllib.error
import urllib.request
from typing import Any

import pytest
from typer.testing import CliRunner

from consumer_kit import ConfigurationError, Settings
from consumer_kit.cli.main import cli
from consumer_kit.outbox_relay import Relay, RelaySettings
from consumer_kit.outbox_relay.cli import app as relay_cli
from consumer_kit.settings import TelemetrySettings
from consumer_kit.worker.health import Health
from tests.fixtures.broker_env import Env
from tests.fixtures.children import stop_gracefully
from tests.fixtures.relay_support import relay_settings
from tests.product.test_first_hour import closed_port


def get(host: str, port: int, path: str = "/ready") -> tuple[int, Any]:
    """``GET http://host:port/path``: (status, body); raises OSError when nothing listens there."""
    url_host = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{url_host}:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return False
    except ConnectionRefusedError:
        return True


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_defaults_are_health_on_this_host_only_and_metrics_on_every_interface(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("CONSUMER_KIT_HEALTH_HOST", "CONSUMER_KIT_METRICS_HOST", "CONSUMER_KIT_RELAY_HEALTH_HOST"):
        monkeypatch.delenv(name, raising=False)
    assert (Settings().health_host, TelemetrySettings().metrics_host) == ("127.0.0.1", "0.0.0.0")
    assert RelaySettings().relay_health_host == "127.0.0.1"
    monkeypatch.setenv("CONSUMER_KIT_HEALTH_HOST", "0.0.0.0")
    monkeypatch.setenv("CONSUMER_KIT_METRICS_HOST", "[::1]")
    monkeypatch.setenv("CONSUMER_KIT_RELAY_HEALTH_HOST", "localhost")
    assert (Settings().health_host, TelemetrySettings().metrics_host) == ("0.0.0.0", "::1")
    assert RelaySettings().relay_health_host == "localhost"


@pytest.mark.parametrize("bad", ["0.0.0.0:8081", "http://0.0.0.0", "", "two words", "300.1.1.1", "host_1"])
def test_a_bad_host_is_a_configuration_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    for variable, group in (("CONSUMER_KIT_HEALTH_HOST", Settings), ("CONSUMER_KIT_METRICS_HOST", TelemetrySettings)):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ConfigurationError, match=f"{variable}=.*must be an IP address or a host name"):
            group.from_environment()
        monkeypatch.delenv(variable)
    monkeypatch.setenv("CONSUMER_KIT_RELAY_HEALTH_HOST", bad)
    with pytest.raises(ConfigurationError, match=r"CONSUMER_KIT_RELAY_HEALTH_HOST=.*must be an IP address"):
        RelaySettings.from_environment()


@pytest.mark.parametrize(("argv", "option"), [
    (["--health-host", "0.0.0.0:80"], "--health-host"), (["--metrics-host", "http://x"], "--metrics-host"),
])
def test_the_commands_refuse_a_bad_host_in_one_line(argv: list[str], option: str) -> None:
    environment = {"CONSUMER_KIT_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/x",
                   "CONSUMER_KIT_BROKER_URL": "amqp://guest:guest@127.0.0.1:1/"}
    worker = CliRunner().invoke(cli, ["worker", "consumer_kit.demo.app:app", *argv], env=environment)
    relay = CliRunner().invoke(relay_cli, argv, env=environment)
    for result in (worker, relay):
        assert result.exit_code == 2, result.output
        assert f"error: {option}=" in result.output and "must be an IP address or a host name" in result.output


async def test_the_health_endpoint_answers_on_the_host_asked_for_and_only_there() -> None:
    hosts = ["127.0.0.2", "0.0.0.0", *(["::1"] if ipv6_loopback() else [])]
    default = Health(stale_after=10, file=None, detail=dict)
    port = await default.serve(0)
    try:
        assert (await asyncio.to_thread(get, "127.0.0.1", port))[0] == 200
        assert await asyncio.to_thread(refused, "127.0.0.2", port)  # the default stays on 127.0.0.1
    finally:
        await default.close()
    for host in hosts:
        health = Health(stale_after=10, file=None, detail=dict)
        port = await health.serve(0, host)
        try:
            reach = "127.0.0.2" if host == "0.0.0.0" else host
            status, body = await asyncio.to_thread(get, reach, port)
            assert status == 200 and json.loads(body)["ready"] is True
            if host == "127.0.0.2":
                assert await asyncio.to_thread(refused, "127.0.0.1", port)
            if host == "0.0.0.0":  # every IPv4 interface
                assert (await asyncio.to_thread(get, "127.0.0.1", port))[0] == 200
        finally:
            await health.close()


async def test_an_address_not_of_this_host_is_refused_at_start_with_the_reason() -> None:
    health = Health(stale_after=10, file=None, detail=dict)
    with pytest.raises(ConfigurationError, match=r"health endpoint: cannot listen on 192\.0\.2\.1 port 0"):
        await health.serve(0, "192.0.2.1")  # TEST-NET-1: no interface of this machine holds it


@pytest.mark.postgres
@pytest.mark.rabbitmq
async def test_a_worker_serves_health_on_its_health_host(env: Env) -> None:
    env.settings = env.settings.model_copy(update={"health_port": 0, "health_host": "127.0.0.2"})
    async with env.worker() as worker:
        async with asyncio.timeout(30):
            while worker.health.port is None:
                await asyncio.sleep(0.05)
        status, _ = await asyncio.to_thread(get, "127.0.0.2", worker.health.port, "/live")
        assert status == 200
        assert await asyncio.to_thread(refused, "127.0.0.1", worker.health.port)


@pytest.mark.postgres
@pytest.mark.rabbitmq
async def test_a_relay_serves_health_on_its_health_host(env: Env) -> None:
    relay = Relay(relay_settings(env.database_url, env.schema, env.rabbitmq_url, relay_health_port=0,
                                 relay_health_host="127.0.0.2"))
    task = asyncio.create_task(relay.run())
    try:
        async with asyncio.timeout(30):
            while relay.health.port is None:
                await asyncio.sleep(0.05)
        status, _ = await asyncio.to_thread(get, "127.0.0.2", relay.health.port, "/live")
        assert status == 200
        assert await asyncio.to_thread(refused, "127.0.0.1", relay.health.port)
    finally:
        relay.request_stop()
        await asyncio.wait_for(task, 30)


@pytest.mark.postgres
@pytest.mark.rabbitmq
@pytest.mark.slow
async def test_worker_command_serves_metrics_and_health_on_the_hosts_given(env: Env) -> None:
    metrics_port, health_port = closed_port(), closed_port()
    environment = env.worker_environment(CONSUMER_KIT_LOG_LEVEL="INFO", CONSUMER_KIT_HEALTH_PORT=str(health_port))
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumer_kit", "worker", "tests.fixtures.apps.invoices_on_test_queue:app",
        "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.2", "--health-host", "127.0.0.2",
        env=environment, stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(30):
            while True:
                try:
                    status, _ = await asyncio.to_thread(get, "127.0.0.2", health_port, "/live")
                    break
                except OSError:  # not listening yet
                    await asyncio.sleep(0.2)
        assert status == 200
        status, metrics = await asyncio.to_thread(get, "127.0.0.2", metrics_port, "/metrics")
        assert status == 200 and b"# TYPE" in metrics
        assert await asyncio.to_thread(refused, "127.0.0.1", metrics_port)
        assert await asyncio.to_thread(refused, "127.0.0.1", health_port)
    finally:
        log = await stop_gracefully(worker)
    assert worker.returncode == 0, log
    assert f"metrics at http://127.0.0.2:{metrics_port}/metrics" in log
    assert f"health endpoint on 127.0.0.2 port {health_port}" in log
