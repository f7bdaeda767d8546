"""A new user's first hour: what the commands refuse, what they say, and what a producer
that knows nothing of consumer-kit must send. Commands run as the user runs them (subprocesses,
or typer's runner for the ones that stop before any I/O)."""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import aio_pika
import psycopg
import pytest
from psycopg import sql
from typer.testing import CliRunner

from consumer_kit import App
from consumer_kit.app import load_app
from consumer_kit.broker import Consumer
from consumer_kit.broker.publishing import Publisher
from consumer_kit.cli.console import OWN_LOGGERS, setup_logging
from consumer_kit.db.embedded_root import private_dir_for
from consumer_kit.errors import ConfigurationError
from tests.fixtures.broker_env import Env
from tests.fixtures.children import stop_gracefully
from tests.fixtures.harness import fetch_all
from tests.fixtures.relay_support import Event, connect, wait_until, write_events

ROOT = Path(__file__).resolve().parents[2]


def user_env(**variables: str) -> dict[str, str]:
    """The environment of a user's shell: none of ours, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONSUMER_KIT_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(variables)
    return env


def run(*argv: str, env: dict[str, str], timeout: float = 60, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
        check=False,
    )


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- no database named ------------------------------------------------------------------------


@pytest.mark.parametrize("argv, program", [
    (["consumer_kit", "worker", "consumer_kit.demo.app:app"], "consumer-kit worker"),
    (["consumer_kit", "migrate"], "consumer-kit migrate"),
    (["consumer_kit.outbox_relay.cli"], "outbox-relay"),
    (["consumer_kit.outbox_relay.cli", "status"], "outbox-relay"),
])
def test_an_unset_database_url_is_refused_and_nothing_embedded_is_created(
    tmp_path: Path, argv: list[str], program: str
) -> None:
    result = run("-m", *argv, cwd=tmp_path, timeout=30, env=user_env(
        CONSUMER_KIT_BROKER_URL="amqp://guest:guest@127.0.0.1:5672/"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: {program} needs a database: set CONSUMER_KIT_DATABASE_URL (e.g. "
        "postgresql://postgres:postgres@127.0.0.1:5432/postgres), or CONSUMER_KIT_DATABASE_URL=embedded "
        "for a throwaway embedded PostgreSQL under .consumer-kit/pgdata"
    ]
    assert list(tmp_path.iterdir()) == []  # no .consumer-kit/pgdata: nothing was started


@pytest.mark.slow
def test_the_embedded_database_is_used_when_asked_for_by_name(tmp_path: Path) -> None:
    """Also as root (a fresh container): there the server runs as ``nobody`` in a private directory
    (tests/db/test_embedded_root.py) and nothing is written into the data directory's parents."""
    parents = [tmp_path, *tmp_path.parents]
    modes = {p: p.stat().st_mode for p in parents}
    env = user_env(CONSUMER_KIT_EMBEDDED_DATA_DIR=str(tmp_path / "pgdata"))
    try:
        first = run("-m", "consumer_kit", "migrate", "--embedded", env=env, cwd=tmp_path, timeout=180)
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith("schema consumer_kit: applied migrations 1,")
        second = run("-m", "consumer_kit", "migrate", cwd=tmp_path, timeout=180,
                     env={**env, "CONSUMER_KIT_DATABASE_URL": "embedded"})
        assert second.returncode == 0, second.stderr
        assert second.stdout == "schema consumer_kit: up to date\n"
        assert {p: p.stat().st_mode for p in parents} == modes  # no parent opened up
    finally:
        shutil.rmtree(private_dir_for(tmp_path / "pgdata"), ignore_errors=True)


@pytest.mark.postgres
def test_migrate_and_relay_status_ignore_worker_settings_they_do_not_use(database_url: str) -> None:
    schema = "ck_" + uuid.uuid4().hex[:10]
    env = user_env(CONSUMER_KIT_DATABASE_URL=database_url, CONSUMER_KIT_RETRY_DELAYS="1;5",
                   CONSUMER_KIT_LOCK_TIMEOUT="0")
    try:
        migrated = run("-m", "consumer_kit", "migrate", "--schema", schema, env=env)
        assert migrated.returncode == 0, migrated.stderr
        assert migrated.stdout.startswith(f"schema {schema}: applied migrations 1,")
        status = run("-m", "consumer_kit.outbox_relay.cli", "status", "--json", "--schema", schema, env=env)
        assert status.returncode == 0, status.stderr
        assert '"parked": 0' in status.stdout
        worker = run("-m", "consumer_kit", "worker", "consumer_kit.demo.app:app", env={
            **env, "CONSUMER_KIT_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672/"})
        assert worker.returncode == 2  # the worker does use them
        assert worker.stderr.splitlines() == [
            "error: CONSUMER_KIT_RETRY_DELAYS=1;5: seconds each, a JSON list or comma-separated, "
            "1 to 20 values between 0 and 43200 (e.g. 1,5,30)",
            "error: CONSUMER_KIT_LOCK_TIMEOUT=0: seconds, must be between 0.001 and 3600 (e.g. 5)",
        ]
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# -- hints ------------------------------------------------------------------------------------


@pytest.mark.parametrize("given, suggested", [
    ("pkg/app.py:app", "pkg.app:app"), ("./pkg/app.py:app", "pkg.app:app"),
    ("pkg/app:worker_app", "pkg.app:worker_app"), ("app.py", "app:app"), ("pkg\\app.py:app", "pkg.app:app"),
])
def test_a_file_path_given_as_app_suggests_the_module_path(given: str, suggested: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_app(given)
    assert str(refused.value) == f"app path {given!r} names a file: use the module name, e.g. '{suggested}'"


def test_a_module_without_attribute_suggests_one() -> None:
    with pytest.raises(ConfigurationError) as refused:
        load_app("consumer_kit.demo.app")
    assert str(refused.value).endswith("e.g. 'consumer_kit.demo.app:app'")


def test_the_example_sender_says_the_broker_is_unreachable_not_that_the_worker_is_missing() -> None:
    port = closed_port()
    result = run("-m", "consumer_kit.demo.send", "--order-id", "1", "--customer", "c", "--amount", "1",
                 env=user_env(CONSUMER_KIT_BROKER_URL=f"amqp://guest:s3cret@127.0.0.1:{port}/"), timeout=30)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:{port}/: ")
    assert "Connect call failed" in line and "worker" not in line and "s3cret" not in line


def test_the_example_sender_refuses_another_broker_at_once() -> None:
    url = "sqs://127.0.0.1:9/?region=us-east-1&tls=false"
    result = run("-m", "consumer_kit.demo.send", "--order-id", "1", "--customer", "c", "--amount", "1",
                 env=user_env(CONSUMER_KIT_BROKER_URL=url), timeout=30)
    assert result.returncode == 2
    assert result.stderr == (f"error: consumer_kit.demo.send publishes to RabbitMQ only, and CONSUMER_KIT_BROKER_URL "
                             f"is {url}: on SQS or Service Bus send the command as examples/invoices/README.md shows\n")


# -- logging ----------------------------------------------------------------------------------


def test_log_level_applies_to_consumer_kit_and_library_log_level_to_the_rest(cli_logging: None) -> None:
    setup_logging("DEBUG")
    assert all(logging.getLogger(f"{name}.x").isEnabledFor(logging.DEBUG) for name in OWN_LOGGERS)
    assert not logging.getLogger("aiormq.connection").isEnabledFor(logging.INFO)
    assert not logging.getLogger("aio_pika.robust_connection").isEnabledFor(logging.INFO)
    assert logging.getLogger("aiormq.connection").isEnabledFor(logging.WARNING)
    setup_logging("ERROR", "DEBUG")
    assert logging.getLogger("aiormq.connection").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("consumer_kit.worker").isEnabledFor(logging.WARNING)


# -- missing vhost, relay start-up probes, summary ----------------------------------------------


def other_vhost(url: str, vhost: str) -> str:
    return re.sub(r"(amqp://[^/]+)/.*$", rf"\1/{vhost}", url)


@pytest.mark.postgres
@pytest.mark.rabbitmq
def test_a_missing_vhost_is_named_at_once_with_the_password_redacted(env: Env) -> None:
    vhost = "ck-missing-" + uuid.uuid4().hex[:6]
    url = other_vhost(env.rabbitmq_url, vhost)
    password = url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    for argv in (["consumer_kit", "worker", "tests.fixtures.apps.invoices_on_test_queue:app"], ["consumer_kit.outbox_relay.cli"]):
        started = time.monotonic()
        result = run("-m", *argv, timeout=30,
                     env=env.worker_environment(CONSUMER_KIT_BROKER_URL=url, PYTHONPATH=str(ROOT)))
        assert time.monotonic() - started < 15, "refused at once, not after the 30 s connect budget"
        assert result.returncode == 2, result.stderr
        error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert error == [
            f"error: cannot connect to RabbitMQ at {url.replace(':' + password + '@', ':***@')}: "
            f"vhost {vhost!r} does not exist or user 'guest' may not use it (rabbitmqctl add_vhost "
            f"{vhost}; rabbitmqctl set_permissions -p {vhost} guest '.*' '.*' '.*')"
        ]
        assert f":{password}@" not in result.stderr


@pytest.mark.postgres
@pytest.mark.rabbitmq
def test_the_relay_probes_the_database_at_start_up_and_fails_like_the_worker(env: Env) -> None:
    refused = env.database_url.replace("postgres@", "ck_no_such_role:pw@", 1)
    assert refused != env.database_url
    started = time.monotonic()
    result = run("-m", "consumer_kit.outbox_relay.cli", timeout=30,
                 env=env.worker_environment(CONSUMER_KIT_DATABASE_URL=refused, PYTHONPATH=str(ROOT)))
    assert time.monotonic() - started < 15
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"error: cannot connect to PostgreSQL at {refused.replace(':pw@', ':***@')}: OperationalError: "
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  role '
        '"ck_no_such_role" does not exist'
    )


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.rabbitmq
def test_the_relay_probes_the_broker_at_start_up_instead_of_looking_healthy(env: Env) -> None:
    port = closed_port()
    result = run("-m", "consumer_kit.outbox_relay.cli", timeout=60, env=env.worker_environment(
        CONSUMER_KIT_BROKER_URL=f"amqp://guest:s3cret@127.0.0.1:{port}/", PYTHONPATH=str(ROOT)))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[-1].startswith(
        f"error: cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:{port}/: AMQPConnectionError: "
    )
    retries = [line for line in lines if ": attempt " in line]
    assert retries, lines  # retried for the connect budget (as the worker does), each time saying why
    assert all("AMQPConnectionError: [Errno 111] Connect call failed" in line for line in retries)
    assert "s3cret" not in result.stderr
    assert " started: " not in result.stderr  # never looked healthy


@pytest.mark.postgres
@pytest.mark.rabbitmq
async def test_the_relay_logs_a_summary_at_info_when_it_stops(env: Env) -> None:
    async with await connect(env.database_url) as conn:
        (event_id,) = await write_events(conn, env.schema, [Event(destination=f"{env.queue}.events")])
    relay = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumer_kit.outbox_relay.cli", env=env.worker_environment(PYTHONPATH=str(ROOT)),
        cwd=str(ROOT), stderr=asyncio.subprocess.PIPE,
    )

    async def published() -> bool:
        return bool(await env.rows(
            "SELECT 1 FROM outbox WHERE event_id = %s AND published_at IS NOT NULL", event_id))

    try:
        await wait_until(published, 30, "the event published")
    finally:
        stderr = await stop_gracefully(relay)
    assert relay.returncode == 0
    summary = [line for line in stderr.splitlines() if " INFO consumer_kit.outbox_relay " in line and " stopped: " in line]
    assert len(summary) == 1, stderr
    assert re.search(r"relay \S+ stopped: .*\bpublished=1\b", summary[0]), summary[0]
    assert re.search(r"\bclaimed=1\b", summary[0]), summary[0]


# -- declare and the producer contract ----------------------------------------------------------


def test_declaring_through_an_adapter_without_topology_support_says_what_to_create() -> None:
    class Bare(Consumer):
        async def subscribe(self, queue, callback, *, prefetch): ...  # type: ignore[no-untyped-def]
        async def pause(self) -> None: ...
        async def resume(self) -> None: ...
        async def stop_consuming(self) -> None: ...
        async def close(self) -> None: ...

    class BarePublisher(Publisher):
        async def publish(self, message):  # type: ignore[no-untyped-def]
            ...

        async def close(self) -> None: ...

    with pytest.raises(ConfigurationError, match=r"not supported by this broker \(Bare\): create queue 'q' "):
        asyncio.run(Bare().declare("q"))
    with pytest.raises(ConfigurationError, match=r"\(BarePublisher\): create 'billing.events' yourself"):
        asyncio.run(BarePublisher().declare("billing.events"))


def test_an_app_names_its_event_destinations_once_each() -> None:
    app = App("x", events=["billing.events"])
    app.publishes("billing.events", "audit.events")
    assert app.events == ["billing.events", "audit.events"]
    with pytest.raises(ConfigurationError):
        app.publishes("")


def test_declare_refuses_the_in_process_broker(cli_logging: None) -> None:
    from consumer_kit.cli.main import cli

    result = CliRunner().invoke(cli, ["declare", "consumer_kit.demo.app:app"], env={"CONSUMER_KIT_BROKER_URL": "memory://"})
    assert result.exit_code == 2
    assert result.stderr.startswith("error: consumer-kit declare needs a real broker")


def test_the_plain_producer_imports_nothing_of_consumer_kit_and_is_the_rabbitmq_page_example() -> None:
    source = (ROOT / "examples" / "invoices" / "plain_producer.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported == {"asyncio", "datetime", "json", "sys", "uuid", "aio_pika"}
    assert f"```python\n{source}```" in (ROOT / "docs" / "brokers" / "rabbitmq.md").read_text()


INVOICE_QUEUES = ["invoices.commands", "invoices.commands.dlq", *(
    f"invoices.commands.retry.{ms}ms" for ms in (1000, 2000, 5000, 30000))]


async def queue_depths(url: str, names: list[str]) -> dict[str, int]:
    connection = await aio_pika.connect(url)
    try:
        depths = {}
        for name in names:
            channel = await connection.channel()
            queue = await channel.declare_queue(name, passive=True)  # raises when missing
            depths[name] = int(queue.declaration_result.message_count or 0)
            await channel.close()
        return depths
    finally:
        await connection.close()


async def delete_example_topology(url: str) -> None:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        for name in INVOICE_QUEUES:
            await channel.queue_delete(name)
        await channel.exchange_delete("billing.events")
    finally:
        await connection.close()


@pytest.mark.postgres
@pytest.mark.rabbitmq
async def test_a_producer_that_knows_nothing_of_consumer_kit_sends_before_any_worker_ran(env: Env) -> None:
    url = env.rabbitmq_url
    environment = env.worker_environment(PYTHONPATH=str(ROOT))
    await delete_example_topology(url)
    try:
        # Before `declare`: the queue does not exist, and both senders say so instead of dropping.
        sender = await asyncio.to_thread(
            run, "-m", "consumer_kit.demo.send", "--order-id", "418", "--customer", "c-1",
            "--amount", "1250", env=environment)
        assert sender.returncode == 2
        assert re.fullmatch(
            r"error: no queue 'invoices.commands' for message_id=[0-9a-f-]{36}: create it with "
            r"`consumer-kit declare consumer_kit.demo.app:app` \(or start the worker\)\n",
            sender.stderr,
        ), sender.stderr
        from consumer_kit.demo.plain_producer import send_create_invoice

        with pytest.raises(aio_pika.exceptions.PublishError):
            await send_create_invoice(url, 418, 2)

        declared = await asyncio.to_thread(
            run, "-m", "consumer_kit", "declare", "consumer_kit.demo.app:app",
            env={k: v for k, v in environment.items() if k != "CONSUMER_KIT_DATABASE_URL"})
        assert declared.returncode == 0, declared.stderr
        assert declared.stdout.splitlines() == [
            "queue invoices.commands (with invoices.commands.dlq, invoices.commands.retry.1000ms, "
            "invoices.commands.retry.2000ms, invoices.commands.retry.5000ms, invoices.commands.retry.30000ms)",
            "event destination billing.events",
        ]
        connection = await aio_pika.connect(url)
        async with connection:
            await (await connection.channel()).get_exchange("billing.events", ensure=True)  # exists

        for _ in range(2):  # a resend: new message id, same operation
            sent = await asyncio.to_thread(
                run, "examples/invoices/plain_producer.py", url, "418", "2", env=environment)
            assert sent.returncode == 0, sent.stderr
        assert (await queue_depths(url, INVOICE_QUEUES))["invoices.commands"] == 2

        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "consumer_kit", "worker", "consumer_kit.demo.app:app",
            env=environment, cwd=str(ROOT), stderr=asyncio.subprocess.PIPE,
        )

        async def both_settled() -> bool:
            completed = await env.rows("SELECT 1 FROM operations WHERE state = 'completed'")
            return len(completed) == 1 and (await queue_depths(url, ["invoices.commands"]))["invoices.commands"] == 0

        try:
            await wait_until(both_settled, 30, "the worker to settle both messages", every=0.2)
        finally:
            log = await stop_gracefully(worker)
        assert worker.returncode == 0, log
        assert "exists with" not in log  # declare made exactly what the worker declares
        assert re.search(r"worker stopped: duplicate=1 executed=1$", log, re.M), log
        assert await env.rows("SELECT order_id, revision, amount_cents FROM invoices") == [(418, 2, 1250)]
        assert await fetch_all(env.database_url, env.schema, "SELECT correlation_id FROM outbox") == [
            ("checkout-418",)]
        assert await queue_depths(url, INVOICE_QUEUES) == dict.fromkeys(INVOICE_QUEUES, 0)
    finally:
        await delete_example_topology(url)


# -- the testing kit, installed -----------------------------------------------------------------


KIT_TEST = '''
from pydantic import BaseModel

from consumer_kit import Context, Envelope, Handler, Result


class Cmd(BaseModel):
    n: int


class Effect(Handler[Cmd]):
    operation_type = "t.cmd"

    def operation_key(self, message: Cmd, envelope: Envelope) -> str:
        return f"k-{message.n}"

    async def handle(self, message: Cmd, ctx: Context) -> Result:
        await ctx.connection.execute("INSERT INTO effects VALUES (%s)", (message.n,))
        return Result(status="ok")


async def test_storm(consumer_kit_harness):
    async with consumer_kit_harness(Effect(), setup_sql="CREATE TABLE effects (n int)") as kit:
        await kit.deliver({"n": 1}, times=3, concurrently=True)
        kit.assert_outcomes({"executed": 1, "duplicate": 2})
        await kit.assert_one_effect("SELECT count(*) FROM effects")


async def test_not_ours():  # no kit fixture: left to the project's own asyncio settings
    pass
'''


def test_the_testing_extra_brings_pytest_and_pytest_asyncio() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {re.split(r"[<>=\[; ]", requirement)[0] for requirement in extras["testing"]} == {
        "pytest", "pytest-asyncio"}


@pytest.mark.postgres
def test_the_testing_kit_runs_async_tests_without_a_marker_outside_this_repository(
    database_url: str, tmp_path: Path
) -> None:
    (tmp_path / "test_my_handler.py").write_text(KIT_TEST)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(("CONSUMER_KIT_", "PYTEST"))}
    env.pop("PYTHONPATH", None)
    env["CONSUMER_KIT_TEST_DATABASE_URL"] = database_url
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "test_my_handler.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    out = result.stdout + result.stderr
    assert re.search(r"^asyncio: mode=(Mode\.)?strict\b", out, re.M | re.I), out  # no ini, no option
    assert f"rootdir: {tmp_path}\n" in out  # nothing of this repository's configuration applies
    assert "PASSED test_my_handler.py::test_storm" in out, out
    # A test without a kit fixture is not the plugin's to mark: strict mode leaves it unrun.
    assert "PASSED test_my_handler.py::test_not_ours" not in out, out
