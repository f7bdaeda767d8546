"""Chaos run: 4 workers and 2 relays on real RabbitMQ and PostgreSQL, killed at random, with a
read-only database window and a poison message.

    python -m tests.system.chaos.run --seed 7 --duration 45 --read-only-window 8   # CI-sized
    python -m tests.system.chaos.run --seed 7 --duration 600                       # the long run (10 min)

What happens:

* a producer sends operations, each delivered 1-3 times at random moments, ~5 % of them with
  one copy carrying a conflicting payload; the messages keep coming through the read-only window;
* 4 ``consumer-kit worker tests.system.chaos.app:app`` processes consume them, 2 ``outbox-relay``
  processes publish the events the handler writes to the outbox;
* a killer SIGKILLs a random worker or relay every 1.5-4 s and restarts it; a few times it
  terminates the run's PostgreSQL backends (``pg_terminate_backend``) and closes the run's
  RabbitMQ connections (``rabbitmqctl close_connection``);
* **poison**: at a seed-chosen moment (10-50 % into the run) the producer sends one operation for
  the account ``poison``, whose handler kills its own process (``os._exit(1)``), in
  ``--poison-copies`` copies (default 2: the duplicate 0.5-3 s after the first). A watchdog
  restarts every process that exits on its own within 0.2 s (1 s after its start at the
  earliest, so a process that cannot start does not loop), through the drain too; an exit not
  explained by the poison (its log line) is a violation (``unexpected_exits``);
* **read-only window**: at a seed-chosen moment (25-40 % into the run) the run sets
  ``ALTER DATABASE <its own> SET default_transaction_read_only = on``, terminates every backend
  of its database (new sessions are read-only, old ones would not be), keeps it so for
  ``--read-only-window`` seconds (default 70; 0: no window) while producing and killing go on,
  then ``RESET``s it. Workers pause and probe, relays back off; both must resume on their own;
* then it stops the chaos, waits for the system to drain (``--drain-timeout``, counted from the
  end of the chaos or of the window, whichever is later) and checks:

  - every healthy operation has exactly one effect (``lost`` 0, ``applied_twice`` 0), a
    ``completed`` ledger row, and the balances equal the winners' sum;
  - dead letters: every conflicting copy as ``payload_conflict`` (once per message id:
    dead-lettering is at least once), every poison copy as ``crashed_worker``, nothing else
    (``healthy_dead_lettered`` 0);
  - the poison operation has no effect and no ledger row, and its ``attempts`` row shows
    ``crashes >= crash_limit`` (``poison_parked``, ``poison_crashes``);
  - no message left ready or unacked; every outbox event published, and received with its event
    id as the message id.

It prints a summary table (``--summary-json`` writes it as JSON too) and exits 1 on any violation
(2 when the system does not drain). Observations that are not violations: ``worker_exits`` (the
poison's deaths), ``relay_exits`` (0, or also counted in ``unexpected_exits``), ``*_tracebacks``
(should be 0; aio-pika's own traceback on a forced connection close is not counted),
``worker_pauses_logged`` ("paused:" lines: the window and the backend terminations) and
``healthy_crashes`` (see below).

**Crashes counted against healthy messages.** A redelivered message runs alone, and a process
that dies then counts a crash against it; the killer's SIGKILL landing there is, by design,
indistinguishable from poison, and ``crash_limit`` of them would park a healthy message: that is
a violation here (lost, healthy_dead_lettered), never hidden. ``healthy_runs_alone`` counts the
runs alone of healthy operations (the exposure), ``healthy_crashes`` the crashes the
``attempts`` table counted against them (``healthy_crashes_max``: the most on one operation) and
``healthy_crashes_live_owner`` those whose recorded owner was never killed nor exited (not a
real death: e.g. two copies of one operation running alone at once on two workers, where the
second run reads the first one's marker as a crash). Runs alone last milliseconds and each
worker is SIGKILLed every ~16 s on average, so even one such crash is rare: seed 7 counted none,
in the CI-sized run and in the 10-minute run alike, so the killer keeps its pace.

**On NATS JetStream** (``--broker-url nats://...``): the same run, with the run's own streams
(``ck-chaos_<tag>_commands``, its ``_dlq``, ``_events``; deleted at the end) instead of a vhost,
events captured from the events stream by an ephemeral consumer, depths and dead letters read from
the streams. NATS has no way to close another client's connection from here (no system account):
the killer's connection closes are RabbitMQ's only (``connection_closes`` stays 0).

Isolation on a shared machine: the run uses its own RabbitMQ virtual host (created and deleted
with ``rabbitmqctl``), so closing connections touches only this run's (``--close-all`` uses
``rabbitmqctl close_all_connections`` instead, for a dedicated broker), and its own PostgreSQL
database ``ck_chaos_<seed>_<id>`` (created on the server of ``--database-url``, dropped
``WITH (FORCE)`` at the end unless ``--keep``), so the read-only window and
``pg_terminate_backend`` touch nothing else; ``PGAPPNAME`` marks the processes' backends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse, urlunparse

import aio_pika
import nats
import psycopg
from nats.js.errors import NotFoundError
from psycopg import sql

from tests.system.chaos.app import POISON_ACCOUNT, command_body, create_tables

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/"
WORKERS, RELAYS = 4, 2
CRASH_LIMIT = 3  # the workers' crash_limit (set explicitly, so the check knows it)
POISON_OP = "op-poison"
WATCHDOG_INTERVAL = 0.2  # seconds between checks for processes that exited on their own
RESTART_MIN_INTERVAL = 1.0  # seconds: a process that cannot start is not restarted in a tight loop
POISON_LOG_LINE = "chaos app: poison operation"  # what tests.system.chaos.app writes before it exits
# consumer_kit.cli.console's log format: "<date> <time> <LEVEL> <logger> <pid> <message>"
_LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ (\S+) \d+ ")


@dataclass
class Summary:
    seed: int
    duration: float
    operations: int = 0
    copies_sent: int = 0
    conflicting_copies: int = 0
    worker_kills: int = 0
    relay_kills: int = 0
    worker_exits: int = 0
    relay_exits: int = 0
    unexpected_exits: int = 0
    pg_terminations: int = 0
    connection_closes: int = 0
    read_only_seconds: float = 0.0
    worker_pauses_logged: int = 0
    worker_tracebacks: int = 0
    relay_tracebacks: int = 0
    effects: int = 0
    lost: int = 0
    applied_twice: int = 0
    dead_lettered: int = 0
    duplicate_dead_letters: int = 0
    expected_dead_letters: int = 0
    healthy_dead_lettered: int = 0
    healthy_runs_alone: int = 0
    healthy_crashes: int = 0
    healthy_crashes_max: int = 0
    healthy_crashes_live_owner: int = 0
    poison_copies: int = 0
    poison_parked: bool = False
    poison_crashes: int = 0
    poison_effects: int = 0
    outbox_events: int = 0
    events_received: int = 0
    duplicate_publishes: int = 0
    drain_seconds: float = 0.0
    violations: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [(k, v) for k, v in asdict(self).items() if k != "violations"]
        rows.append(("violations", len(self.violations)))
        width = max(len(k) for k, _ in rows)
        lines = [f"{'metric'.ljust(width)} | value", f"{'-' * width}-+-------"]
        lines += [f"{k.ljust(width)} | {v if not isinstance(v, float) else round(v, 1)}" for k, v in rows]
        lines += [f"VIOLATION: {v}" for v in self.violations[:50]]
        return "\n".join(lines)


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # One generator per concern, so the killer's choices do not depend on the producer's pace.
        self.rng = random.Random(f"{args.seed}:producer")
        self.killer_rng = random.Random(f"{args.seed}:killer")
        plan = random.Random(f"{args.seed}:plan")
        self.poison_at = plan.uniform(0.10, 0.50) * args.duration  # seconds into the run
        self.read_only_at = plan.uniform(0.25, 0.40) * args.duration
        self.summary = Summary(seed=args.seed, duration=args.duration)
        tag = f"{args.seed}_{uuid.uuid4().hex[:6]}"
        self.schema = f"ck_chaos_{tag}"
        self.dbname = f"ck_chaos_{tag}"
        self.vhost = f"ck-chaos-{tag}"
        self.queue = f"ck-chaos.{tag}.commands"
        self.events = f"ck-chaos.{tag}.events"
        self.capture = f"ck-chaos.{tag}.capture"
        self.appname = f"ck-chaos-{tag}"
        self.admin_url = args.database_url  # where the run's own database is created and dropped
        self.database_url = _with_database(args.database_url, self.dbname)
        base = urlparse(args.broker_url)
        self.on_nats = base.scheme == "nats"
        self.broker_url = args.broker_url if self.on_nats else urlunparse(
            base._replace(path="/" + quote(self.vhost, safe="")))
        self.nats: Any = None  # the observer's NATS client (on NATS)
        self.streams = [re.sub(r"[^A-Za-z0-9_-]", "_", n) for n in (self.queue, self.events)]
        self.logdir = Path(args.logdir or f"/tmp/{self.appname}")
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned = Counter[str]()
        self.started_at: dict[str, float] = {}  # name -> time.monotonic() of its last start
        self.unexpected: list[str] = []  # exits not explained by the poison
        self.ended: dict[int, str] = {}  # pid -> "killed" or "exit <code>"
        # op key -> amounts of its copies, in send order (healthy operations only)
        self.copies: dict[str, list[int]] = {}
        self.poison_ids: list[str] = []  # message ids of the poison copies sent
        self.received_ids: Counter[str] = Counter()
        self.dead: dict[str, tuple[str, str]] = {}  # message id -> (operation key, reason)
        self.dead_copies = 0
        self.winners: dict[str, int] = {}  # op key -> the amount of its one effect
        self.connection: aio_pika.abc.AbstractRobustConnection | None = None
        self.database_created = False
        self.vhost_created = False

    # -- processes ---------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "CONSUMER_KIT_CRASH_AT"}
        env.update(
            CONSUMER_KIT_DATABASE_URL=self.database_url,
            CONSUMER_KIT_BROKER_URL=self.broker_url,
            CONSUMER_KIT_DB_SCHEMA=self.schema,
            CONSUMER_KIT_MAX_DELIVERIES="25",  # kills push counts up; only conflicts may dead-letter
            CONSUMER_KIT_CRASH_LIMIT=str(CRASH_LIMIT),
            CONSUMER_KIT_RETRY_DELAYS="[0.2]",
            CONSUMER_KIT_IN_PROGRESS_DELAY="0.2",
            CONSUMER_KIT_LOCK_TIMEOUT="2",
            CONSUMER_KIT_SHUTDOWN_TIMEOUT="5",
            # A killed relay's claimed rows wait out its lease before another relay takes them
            # over: 15 s instead of 60 keeps the drain short (at least 1.25 x settle_timeout).
            CONSUMER_KIT_RELAY_CLAIM_TIMEOUT="15",
            CONSUMER_KIT_LOG_LEVEL="WARNING",
            CK_CHAOS_QUEUE=self.queue,
            CK_CHAOS_EVENTS=self.events,
            CK_CHAOS_BATCH=str(self.args.batch),
            PGAPPNAME=self.appname,
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        return env

    def _command(self, role: str) -> list[str]:
        if role == "worker":
            cli = shutil.which("consumer-kit") or _sibling("consumer-kit")
            if cli:
                return [cli, "worker", "tests.system.chaos.app:app", "--concurrency", "8"]
            return [sys.executable, str(ROOT / "tests" / "system" / "chaos" / "worker_main.py")]
        cli = shutil.which("outbox-relay") or _sibling("outbox-relay")
        if not cli:
            raise SystemExit("outbox-relay is not installed (pip install -e .)")
        return [cli, "--schema", self.schema]

    def start(self, name: str) -> None:
        role = name.split("-")[0]
        self.spawned[name] += 1
        self.started_at[name] = time.monotonic()
        with open(self.logdir / f"{name}.{self.spawned[name]}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(
                self._command(role), env=self._env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            return  # it exited on its own, just now: restart_exited() records it
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.ended[proc.pid] = "killed"
        if name.startswith("worker"):
            self.summary.worker_kills += 1
        else:
            self.summary.relay_kills += 1

    def restart_exited(self) -> None:
        """Record and restart every process that exited on its own (the poison's workers exit 1);
        one that exits within RESTART_MIN_INTERVAL of its start waits for the next call."""
        for name, proc in list(self.procs.items()):
            if proc.poll() is None:
                continue
            if proc.pid not in self.ended:
                self._record_exit(name, proc)
            if time.monotonic() - self.started_at[name] >= RESTART_MIN_INTERVAL:
                self.start(name)

    def _record_exit(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        self.ended[proc.pid] = f"exit {proc.returncode}"
        log = self.logdir / f"{name}.{self.spawned[name]}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        if name.startswith("worker"):
            self.summary.worker_exits += 1
        else:
            self.summary.relay_exits += 1
        if not (name.startswith("worker") and POISON_LOG_LINE in text):
            last = text.strip().splitlines()[-1:] or ["<empty log>"]
            self.unexpected.append(f"{log.name} (pid {proc.pid}) exited with {proc.returncode}: {last[0][:300]}")
            print(f"unexpected exit: {self.unexpected[-1]}", file=sys.stderr)

    async def watchdog(self) -> None:
        while True:
            self.restart_exited()
            await asyncio.sleep(WATCHDOG_INTERVAL)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- set-up and tear-down -------------------------------------------------------------------

    async def setup(self) -> None:
        if not self.on_nats:
            _rabbitmqctl("add_vhost", self.vhost)
            self.vhost_created = True
            _rabbitmqctl("set_permissions", "-p", self.vhost, urlparse(self.args.broker_url).username or "guest",
                         ".*", ".*", ".*")
        async with await psycopg.AsyncConnection.connect(self.admin_url, autocommit=True) as conn:
            await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.dbname)))
        self.database_created = True
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            await create_tables(conn, self.schema)
        if self.on_nats:
            await self._setup_nats()
            return
        self.connection = await aio_pika.connect_robust(self.broker_url)
        channel = await self.connection.channel()
        exchange = await channel.declare_exchange(self.events, aio_pika.ExchangeType.TOPIC, durable=True)
        capture = await channel.declare_queue(self.capture, durable=True)
        await capture.bind(exchange, "#")
        await capture.consume(self._on_event)
        self.publish_channel = await self.connection.channel(publisher_confirms=True)

    async def _setup_nats(self) -> None:
        """The events stream and an ephemeral consumer that captures every event published."""
        self.nats = await nats.connect(self.broker_url.split("?", 1)[0])
        js = self.nats.jetstream()
        events = self.streams[1]
        await js.add_stream(name=events, subjects=[self.events, f"{self.events}.>"])

        async def on_event(msg: Any) -> None:
            self.received_ids[(msg.headers or {}).get("Nats-Msg-Id", "<none>")] += 1
            await msg.ack()

        await js.subscribe(f"{self.events}.>", stream=events, cb=on_event, manual_ack=True)
        self.js = js

    async def teardown(self) -> None:
        if self.connection is not None:
            await self.connection.close()
        if self.nats is not None:
            if not self.args.keep:
                for name in (self.streams[0], f"{self.streams[0]}_dlq", self.streams[1]):
                    try:
                        await self.js.delete_stream(name)
                    except NotFoundError:
                        pass
            await self.nats.close()
        if self.args.keep:
            print(f"kept: database {self.dbname} (schema {self.schema}), vhost {self.vhost}", file=sys.stderr)
            return
        if self.vhost_created:
            _rabbitmqctl("delete_vhost", self.vhost, check=False)
        if self.database_created:
            async with await psycopg.AsyncConnection.connect(self.admin_url, autocommit=True) as conn:
                await conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.dbname))
                )

    async def _on_event(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self.received_ids[message.message_id or "<none>"] += 1
        await message.ack()

    async def _queue_ready(self) -> bool:
        if self.on_nats:
            try:
                await self.js.stream_info(self.streams[0])
                return True
            except NotFoundError:
                return False
        assert self.connection is not None
        channel = await self.connection.channel()
        try:
            await channel.declare_queue(self.queue, passive=True)
            return True
        except Exception:  # noqa: BLE001 - not declared yet: the passive declare closes the channel
            return False
        finally:
            if not channel.is_closed:
                await channel.close()

    # -- producer and killer --------------------------------------------------------------------

    async def produce(self, started: float, until: float) -> None:
        loop = asyncio.get_running_loop()
        outgoing: asyncio.Queue[tuple[str, int, str]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(outgoing))
        n = 0
        poison_sent = self.args.poison_copies == 0
        while loop.time() < until:
            if not poison_sent and loop.time() >= started + self.poison_at:
                poison_sent = True
                outgoing.put_nowait((POISON_OP, 1, POISON_ACCOUNT))
                for _ in range(self.args.poison_copies - 1):
                    loop.call_later(self.rng.uniform(0.5, 3.0), outgoing.put_nowait, (POISON_OP, 1, POISON_ACCOUNT))
            n += 1
            op = f"op-{n:06d}"
            amount = self.rng.randint(1, 1000)
            amounts = [amount] * self.rng.randint(1, 3)
            if self.rng.random() < 0.05:
                amounts.insert(self.rng.randrange(len(amounts) + 1), amount + 1)
            self.copies[op] = amounts
            outgoing.put_nowait((op, amounts[0], "acct-1"))
            for later in amounts[1:]:
                loop.call_later(self.rng.uniform(0.0, 3.0), outgoing.put_nowait, (op, later, "acct-1"))
            await asyncio.sleep(1 / self.args.rate)  # pacing the producer, not synchronisation
        await asyncio.sleep(3.1)  # let the delayed copies of the last operations be queued
        await outgoing.join()
        sender.cancel()

    async def _send(self, outgoing: asyncio.Queue[tuple[str, int, str]]) -> None:
        while True:
            op, amount, account = await outgoing.get()
            message_id = str(uuid.uuid4())
            try:
                if self.on_nats:
                    await self.js.publish(self.queue, command_body(op, amount, account), headers={
                        "operation-id": op, "message-type": "ChaosCommand", "Nats-Msg-Id": message_id})
                else:
                    await self._publish_amqp(op, amount, account, message_id)
                self.summary.copies_sent += 1
                if account == POISON_ACCOUNT:
                    self.poison_ids.append(message_id)
            finally:
                outgoing.task_done()

    async def _publish_amqp(self, op: str, amount: int, account: str, message_id: str) -> None:
        await self.publish_channel.default_exchange.publish(
            aio_pika.Message(
                command_body(op, amount, account), message_id=message_id,
                headers={"operation-id": op, "message-type": "ChaosCommand"},
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=self.queue,
        )

    async def killer(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        rng = self.killer_rng
        next_pg = loop.time() + rng.uniform(4, 8)
        next_amqp = loop.time() + rng.uniform(6, 12)
        while loop.time() < until:
            await asyncio.sleep(rng.uniform(1.5, 4.0))
            if loop.time() >= until:
                break
            self.restart_exited()  # a process that died on its own is the watchdog's, not a kill
            name = rng.choice(sorted(self.procs))
            if self.procs[name].poll() is None:
                self.kill(name)
                self.start(name)
            if loop.time() >= next_pg:
                await self._terminate_backends()
                next_pg = loop.time() + rng.uniform(8, 16)
            if loop.time() >= next_amqp and not self.on_nats:
                await asyncio.to_thread(self._close_connections)
                next_amqp = loop.time() + rng.uniform(10, 20)

    async def _terminate_backends(self, *, whole_database: bool = False) -> None:
        """Terminate the run's processes' backends, or (``whole_database``) every backend of the
        run's own database but this one; never another database's."""
        query = (
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()"
        )
        params: tuple[str, ...] = (self.dbname,)
        if not whole_database:
            query += " AND application_name = %s"
            params += (self.appname,)
        async with await psycopg.AsyncConnection.connect(self.admin_url, autocommit=True) as conn:
            cur = await conn.execute(query, params)
            row = await cur.fetchone()
            self.summary.pg_terminations += int(row[0]) if row else 0

    def _close_connections(self) -> None:
        if self.args.close_all:
            _rabbitmqctl("-p", self.vhost, "close_all_connections", "chaos")  # this run's vhost only: the broker is shared
            self.summary.connection_closes += 1
            return
        out = _rabbitmqctl("list_connections", "pid", "vhost", "client_properties", "--no-table-headers")
        for line in out.splitlines():
            parts = line.split("\t")
            # the run's own producer/capture connection is left alone: it is the observer
            if len(parts) >= 2 and parts[1] == self.vhost and "consumer-kit" in line:
                _rabbitmqctl("close_connection", parts[0], "chaos", check=False)
                self.summary.connection_closes += 1

    # -- the read-only window ---------------------------------------------------------------------

    async def read_only_window(self, started: float) -> None:
        if self.args.read_only_window <= 0:
            return
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, started + self.read_only_at - loop.time()))
        await self._set_read_only(True)
        began = loop.time()
        try:
            # Sessions keep the setting they started with: end them, so every new one is read-only.
            await self._terminate_backends(whole_database=True)
            await asyncio.sleep(self.args.read_only_window)
        finally:
            await self._set_read_only(False)
            self.summary.read_only_seconds = loop.time() - began

    async def _set_read_only(self, on: bool) -> None:
        statement = "ALTER DATABASE {} SET default_transaction_read_only = on" if on else \
            "ALTER DATABASE {} RESET default_transaction_read_only"
        async with await psycopg.AsyncConnection.connect(self.admin_url, autocommit=True) as conn:
            await conn.execute(sql.SQL(statement).format(sql.Identifier(self.dbname)))
        print(f"{time.strftime('%H:%M:%S')} database {self.dbname} {'read-only' if on else 'writable'}",
              file=sys.stderr)

    # -- drain and verify -----------------------------------------------------------------------

    async def drained(self) -> bool:
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            cur = await conn.execute(
                sql.SQL(
                    "SELECT (SELECT count(*) FROM {ops} WHERE state = 'completed'), "
                    "(SELECT count(*) FROM {ops} WHERE state <> 'completed'), "
                    "(SELECT count(*) FROM {outbox} WHERE published_at IS NULL), "
                    "(SELECT array_agg(event_id::text) FROM {outbox})"
                ).format(ops=sql.Identifier(self.schema, "operations"),
                         outbox=sql.Identifier(self.schema, "outbox"))
            )
            row = await cur.fetchone()
        assert row is not None
        completed, other, unpublished, event_ids = row
        if completed < len(self.copies) or other or unpublished:
            return False
        if any(e not in self.received_ids for e in event_ids or []):
            return False
        # The poison's copies are in the queue (ready or unacked) until they are parked.
        return all(n == 0 for _, n in await self._depths())

    async def _depths(self) -> list[tuple[str, int]]:
        if self.on_nats:
            return [(self.queue, int((await self.js.stream_info(self.streams[0])).state.messages))]
        return await asyncio.to_thread(self._queue_depths)

    def _queue_depths(self) -> list[tuple[str, int]]:
        out = _rabbitmqctl("list_queues", "-p", self.vhost, "name", "messages", "--no-table-headers")
        depths = []
        for line in out.splitlines():
            parts = line.split("\t")
            if len(parts) == 2 and parts[0].startswith(self.queue) and not parts[0].endswith(".dlq"):
                depths.append((parts[0], int(parts[1])))
        return depths

    async def collect_dead_letters(self) -> None:
        if self.on_nats:
            await self._collect_nats_dead_letters()
            return
        assert self.connection is not None
        channel = await self.connection.channel()
        dlq = await channel.declare_queue(self.queue + ".dlq", passive=True)
        while True:
            message = await dlq.get(no_ack=True, fail=False)
            if message is None:
                break
            headers = message.headers or {}
            # Dead-lettering is at least once: a worker killed between the DLQ copy's confirm and
            # the original's ack dead-letters the redelivery again (same message id).
            self.dead_copies += 1
            self.dead[message.message_id or f"<none-{self.dead_copies}>"] = (
                str(headers.get("operation-id")), str(headers.get("x-dead-letter-reason"))
            )
        await channel.close()

    async def _collect_nats_dead_letters(self) -> None:
        dlq = f"{self.streams[0]}_dlq"
        state = (await self.js.stream_info(dlq)).state
        for seq in range(int(state.first_seq or 1), int(state.last_seq or 0) + 1):
            try:
                raw = await self.js.get_msg(dlq, seq=seq)
            except NotFoundError:
                continue
            headers = raw.headers or {}
            self.dead_copies += 1  # at least once, as on RabbitMQ
            self.dead[headers.get("x-consumer-kit-message-id") or f"<none-{self.dead_copies}>"] = (
                str(headers.get("operation-id")), str(headers.get("x-dead-letter-reason"))
            )

    def read_logs(self) -> None:
        """Count what the processes logged: pauses and tracebacks (but aio-pika's own, which
        logs every forced connection close with one)."""
        s = self.summary
        for path in sorted(self.logdir.glob("*.log")):
            tracebacks = 0
            logger_name = ""
            for line in path.read_text(errors="replace").splitlines():
                record = _LOG_RECORD.match(line)
                if record:
                    logger_name = record.group(1)
                    if path.name.startswith("worker") and " paused: " in line:
                        s.worker_pauses_logged += 1
                elif line.startswith("Traceback (most recent call last)"):
                    tracebacks += not logger_name.startswith(("aiormq", "aio_pika"))
            if path.name.startswith("worker"):
                s.worker_tracebacks += tracebacks
            else:
                s.relay_tracebacks += tracebacks

    async def verify(self) -> None:
        s = self.summary
        v = s.violations
        s.operations = len(self.copies)
        s.conflicting_copies = sum(len(set(a)) > 1 for a in self.copies.values())
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            async def rows(query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
                cur = await conn.execute(
                    sql.SQL(query).format(
                        effects=sql.Identifier(self.schema, "effects"),
                        ops=sql.Identifier(self.schema, "operations"),
                        outbox=sql.Identifier(self.schema, "outbox"),
                        accounts=sql.Identifier(self.schema, "accounts"),
                        attempts=sql.Identifier(self.schema, "attempts"),
                    ),
                    params,
                )
                return await cur.fetchall()

            effects = await rows("SELECT operation_key, count(*), min(amount) FROM {effects} GROUP BY 1")
            states = dict(await rows("SELECT state, count(*) FROM {ops} WHERE key <> %s GROUP BY 1", (POISON_OP,)))
            poison_rows = await rows("SELECT state FROM {ops} WHERE key = %s", (POISON_OP,))
            outbox = await rows("SELECT event_id::text, published_at IS NOT NULL FROM {outbox}")
            balance = (await rows("SELECT coalesce(sum(balance), 0) FROM {accounts}"))[0][0]
            attempts = await rows("SELECT key, crashes, history FROM {attempts}")
        self._verify_effects(effects, states, balance)
        self._verify_dead_letters()
        self._verify_poison(effects, poison_rows, attempts)
        self._measure_healthy_crashes(attempts)
        self._verify_outbox(outbox)
        s.unexpected_exits = len(self.unexpected)
        if self.unexpected:
            v.append(f"{len(self.unexpected)} processes exited on their own without the poison, e.g. "
                     f"{self.unexpected[:3]}")
        for name, depth in await self._depths():
            if depth:
                v.append(f"queue {name} still holds {depth} messages")

    def _verify_effects(self, effects: list[tuple[Any, ...]], states: dict[str, int], balance: int) -> None:
        s, v = self.summary, self.summary.violations
        healthy = [(op, n, amount) for op, n, amount in effects if op in self.copies]
        s.effects = sum(n for _, n, _ in healthy)
        self.winners = {op: amount for op, _, amount in healthy}
        twice = [(op, n) for op, n, _ in healthy if n != 1]
        s.applied_twice = len(twice)
        if twice:
            v.append(f"{len(twice)} operations applied more than once, e.g. {twice[:5]}")
        strangers = sorted({op for op, _, _ in effects} - set(self.copies) - {POISON_OP})
        if strangers:
            v.append(f"effects of unknown operations: {strangers[:5]}")
        missing = set(self.copies) - set(self.winners)
        s.lost = len(missing)
        if missing:
            v.append(f"{len(missing)} operations without an effect (lost), e.g. {sorted(missing)[:5]}")
        if set(states) - {"completed"}:
            v.append(f"ledger rows not terminal/completed: {states}")
        if states.get("completed", 0) != s.operations:
            v.append(f"{states.get('completed', 0)} completed ledger rows for {s.operations} operations")
        if balance != sum(self.winners.values()):
            v.append(f"balance {balance} != sum of winning amounts {sum(self.winners.values())}")

    def _verify_dead_letters(self) -> None:
        """Every conflicting copy (amount differs from the winner's) dead-lettered as
        payload_conflict, every poison copy as crashed_worker, nothing else."""
        s, v = self.summary, self.summary.violations
        expected = +Counter(
            {op: sum(a != self.winners.get(op) for a in amounts)
             for op, amounts in self.copies.items() if op in self.winners}
        )
        s.expected_dead_letters = sum(expected.values()) + len(self.poison_ids)
        s.dead_lettered = len(self.dead)
        s.duplicate_dead_letters = self.dead_copies - len(self.dead)
        healthy = [(op, reason) for op, reason in self.dead.values() if op != POISON_OP]
        wrong = [(op, reason) for op, reason in healthy if reason != "payload_conflict"]
        conflicts = Counter(op for op, reason in healthy if reason == "payload_conflict")
        excess = {op: n - expected[op] for op, n in conflicts.items() if n > expected[op]}
        s.healthy_dead_lettered = len(wrong) + sum(excess.values())
        if wrong:
            v.append(f"{len(wrong)} healthy messages dead-lettered, e.g. {wrong[:5]}")
        if conflicts != expected:
            diff = {op: (conflicts[op], expected[op]) for op in set(conflicts) | set(expected)
                    if conflicts[op] != expected[op]}
            v.append(f"payload_conflict dead-letters per operation (got, expected) differ: "
                     f"{dict(list(diff.items())[:10])}")

    def _verify_poison(
        self, effects: list[tuple[Any, ...]], poison_rows: list[tuple[Any, ...]],
        attempts: list[tuple[Any, ...]],
    ) -> None:
        s, v = self.summary, self.summary.violations
        s.poison_copies = len(self.poison_ids)
        if self.args.poison_copies and not self.poison_ids:
            v.append("the poison operation was never sent (is the run shorter than its moment?)")
            return
        if not self.poison_ids:
            return
        s.poison_effects = sum(n for op, n, _ in effects if op == POISON_OP)
        if s.poison_effects:
            v.append(f"the poison operation has {s.poison_effects} effects")
        if poison_rows:
            v.append(f"the poison operation has a ledger row: {poison_rows}")
        reasons = {mid: self.dead.get(mid, (POISON_OP, "<not dead-lettered>"))[1] for mid in self.poison_ids}
        s.poison_parked = all(reason == "crashed_worker" for reason in reasons.values())
        if not s.poison_parked:
            v.append(f"poison copies not parked as crashed_worker: {reasons}")
        s.poison_crashes = max((crashes for key, crashes, _ in attempts if key == POISON_OP), default=0)
        if s.poison_crashes < CRASH_LIMIT:
            v.append(f"the poison's attempts row shows {s.poison_crashes} crashes (crash_limit {CRASH_LIMIT})")

    def _measure_healthy_crashes(self, attempts: list[tuple[Any, ...]]) -> None:
        """Crashes counted against healthy operations, and whether the recorded owner died."""
        s = self.summary
        for key, crashes, history in attempts:
            if key == POISON_OP:
                continue
            s.healthy_runs_alone += sum(entry.get("kind") == "run_alone" for entry in history)
            if not crashes:
                continue
            s.healthy_crashes += crashes
            s.healthy_crashes_max = max(s.healthy_crashes_max, crashes)
            for entry in history:
                if entry.get("kind") != "crash":
                    continue
                owner = str(entry.get("worker") or "")
                pid = int(owner.split(":")[1]) if owner.count(":") >= 2 and owner.split(":")[1].isdigit() else 0
                if pid not in self.ended:
                    s.healthy_crashes_live_owner += 1
                    print(f"crash counted against {key} with a live owner: {entry}", file=sys.stderr)

    def _verify_outbox(self, outbox: list[tuple[Any, ...]]) -> None:
        """One event per effect, each published with its event id as the message id."""
        s, v = self.summary, self.summary.violations
        s.outbox_events = len(outbox)
        if len(outbox) != s.effects:
            v.append(f"{len(outbox)} outbox events for {s.effects} effects")
        unpublished = [e for e, published in outbox if not published]
        if unpublished:
            v.append(f"{len(unpublished)} outbox events never marked published")
        event_ids = {e for e, _ in outbox}
        s.events_received = len(set(self.received_ids) & event_ids)
        s.duplicate_publishes = sum(n - 1 for e, n in self.received_ids.items() if e in event_ids)
        if event_ids - set(self.received_ids):
            v.append(f"{len(event_ids - set(self.received_ids))} outbox events never received")
        strangers = set(self.received_ids) - event_ids
        if strangers:
            v.append(f"{len(strangers)} received events with unknown message ids")

    # -- the run ---------------------------------------------------------------------------------

    async def run(self) -> Summary:
        watchdog: asyncio.Task[None] | None = None
        try:
            await self.setup()
            for i in range(WORKERS):
                self.start(f"worker-{i}")
            for i in range(RELAYS):
                self.start(f"relay-{i}")
            async with asyncio.timeout(60):
                while not await self._queue_ready():
                    await asyncio.sleep(0.2)  # waiting for the workers to declare the queue
            watchdog = asyncio.create_task(self.watchdog())
            loop = asyncio.get_running_loop()
            started = loop.time()
            until = started + self.args.duration
            await asyncio.gather(
                self.produce(started, until), self.killer(until), self.read_only_window(started)
            )
            drain_started = loop.time()
            try:
                async with asyncio.timeout(self.args.drain_timeout):
                    while not await self.drained():
                        await asyncio.sleep(0.5)  # polling the ledger, outbox and queues
            except TimeoutError:
                self.summary.violations.append(f"did not drain within {self.args.drain_timeout} s")
            self.summary.drain_seconds = loop.time() - drain_started
            await self.collect_dead_letters()
            await self.verify()
        finally:
            if watchdog is not None:
                watchdog.cancel()
            self.stop_all()
            self.read_logs()
            await self.teardown()
        return self.summary


def _with_database(url: str, dbname: str) -> str:
    """``url`` with its database (the path) replaced by ``dbname``."""
    return urlunparse(urlparse(url)._replace(path="/" + dbname))


def _sibling(name: str) -> str | None:
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else None


def _rabbitmqctl(*args: str, check: bool = True) -> str:
    result = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of producing and killing")
    parser.add_argument("--rate", type=float, default=20.0, help="operations per second")
    parser.add_argument("--read-only-window", type=float, default=70.0,
                        help="seconds the run's database is read-only (0: no window)")
    parser.add_argument("--poison-copies", type=int, default=2,
                        help="copies of the poison operation sent (0: no poison)")
    parser.add_argument("--drain-timeout", type=float, default=120.0,
                        help="seconds to drain after the chaos and the read-only window end")
    parser.add_argument("--database-url", default=os.environ.get("CONSUMER_KIT_TEST_DATABASE_URL", DEFAULT_DATABASE_URL),
                        help="the server (and a database to connect to) where the run creates its own database")
    parser.add_argument("--broker-url", default=os.environ.get("CONSUMER_KIT_TEST_BROKER_URL", DEFAULT_BROKER_URL))
    parser.add_argument("--close-all", action="store_true", help="rabbitmqctl close_all_connections (dedicated broker only)")
    parser.add_argument("--batch", type=int, default=1, help="the workers' batch_size (1: no batches)")
    parser.add_argument("--keep", action="store_true", help="keep the database and vhost for inspection")
    parser.add_argument("--logdir", help="process logs (default /tmp/ck-chaos-<seed>_<id>)")
    parser.add_argument("--summary-json", help="also write the summary as JSON to this file")
    args = parser.parse_args(argv)
    chaos = Chaos(args)
    summary = asyncio.run(chaos.run())
    print(summary.table())
    print(f"process logs: {chaos.logdir}")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(asdict(summary), indent=2))
    if any(v.startswith("did not drain") for v in summary.violations):
        return 2
    return 1 if summary.violations else 0


if __name__ == "__main__":
    sys.exit(main())
