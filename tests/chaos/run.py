"""Chaos run: 4 workers and 2 relays on real RabbitMQ and PostgreSQL, killed at random.

    python -m tests.chaos.run --seed 7 --duration 60          # CI-sized
    python -m tests.chaos.run --seed 7 --duration 600         # the long run (10 minutes)

What happens (issue 4):

* a producer sends operations, each delivered 1-3 times at random moments, ~5 % of them with
  one copy carrying a conflicting payload;
* 4 ``consumer-kit worker tests.chaos.app:app`` processes consume them, 2 ``outbox-relay``
  processes publish the events the handler writes to the outbox;
* a killer SIGKILLs a random worker or relay every 1.5-4 s and restarts it; a few times it
  terminates the run's PostgreSQL backends (``pg_terminate_backend``) and closes the run's
  RabbitMQ connections (``rabbitmqctl close_connection``);
* then it stops the chaos, waits for the system to drain and checks: exactly one effect per
  operation, every conflicting copy dead-lettered as ``payload_conflict`` (once per message id:
  dead-lettering is at least once) and nothing else
  dead-lettered, every ledger row terminal, no message left ready or unacked, every outbox event
  published at least once with its event id as the message id, balances equal to the winners' sum.

It prints a summary table and exits 1 on any violation (2 when the system does not drain).

Isolation on a shared machine: the run uses its own RabbitMQ virtual host (created and deleted
with ``rabbitmqctl``), so closing connections touches only this run's (``--close-all`` uses
``rabbitmqctl close_all_connections`` instead, for a dedicated broker), its own PostgreSQL schema,
and ``PGAPPNAME`` marks its backends, so ``pg_terminate_backend`` touches only those.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
import psycopg
from psycopg import sql

from tests.chaos.app import command_body, create_tables

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672/"
WORKERS, RELAYS = 4, 2


@dataclass
class Summary:
    seed: int
    duration: float
    operations: int = 0
    copies_sent: int = 0
    conflicting_copies: int = 0
    worker_kills: int = 0
    relay_kills: int = 0
    pg_terminations: int = 0
    connection_closes: int = 0
    effects: int = 0
    dead_lettered: int = 0
    duplicate_dead_letters: int = 0
    expected_dead_letters: int = 0
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
        self.rng = random.Random(args.seed)
        self.summary = Summary(seed=args.seed, duration=args.duration)
        tag = f"{args.seed}_{uuid.uuid4().hex[:6]}"
        self.schema = f"ck_chaos_{tag}"
        self.vhost = f"ck-chaos-{tag}"
        self.queue = f"ck-chaos.{tag}.commands"
        self.events = f"ck-chaos.{tag}.events"
        self.capture = f"ck-chaos.{tag}.capture"
        self.appname = f"ck-chaos-{tag}"
        self.database_url = args.database_url
        base = urlparse(args.broker_url)
        self.broker_url = urlunparse(base._replace(path="/" + quote(self.vhost, safe="")))
        self.logdir = Path(args.logdir or f"/tmp/{self.appname}")
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned = Counter[str]()
        # op key -> amounts of its copies, in send order
        self.copies: dict[str, list[int]] = {}
        self.received_ids: Counter[str] = Counter()
        self.dead: dict[str, tuple[str, str]] = {}  # message id -> (operation key, reason)
        self.dead_copies = 0

    # -- processes ---------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "CONSUMER_KIT_CRASH_AT"}
        env.update(
            CONSUMER_KIT_DATABASE_URL=self.database_url,
            CONSUMER_KIT_BROKER_URL=self.broker_url,
            CONSUMER_KIT_DB_SCHEMA=self.schema,
            CONSUMER_KIT_MAX_DELIVERIES="25",  # kills push counts up; only conflicts may dead-letter
            CONSUMER_KIT_RETRY_DELAYS="[0.2]",
            CONSUMER_KIT_IN_PROGRESS_DELAY="0.2",
            CONSUMER_KIT_LOCK_TIMEOUT="2",
            CONSUMER_KIT_SHUTDOWN_TIMEOUT="5",
            CONSUMER_KIT_LOG_LEVEL="WARNING",
            CK_CHAOS_QUEUE=self.queue,
            CK_CHAOS_EVENTS=self.events,
            PGAPPNAME=self.appname,
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        return env

    def _command(self, role: str) -> list[str]:
        if role == "worker":
            cli = shutil.which("consumer-kit") or _sibling("consumer-kit")
            if cli:
                return [cli, "worker", "tests.chaos.app:app", "--concurrency", "8"]
            return [sys.executable, str(ROOT / "tests" / "chaos" / "worker_main.py")]
        cli = shutil.which("outbox-relay") or _sibling("outbox-relay")
        if not cli:
            raise SystemExit("outbox-relay is not installed (pip install -e .)")
        return [cli, "--schema", self.schema]

    def start(self, name: str) -> None:
        role = name.split("-")[0]
        self.spawned[name] += 1
        log = open(self.logdir / f"{name}.{self.spawned[name]}.log", "wb")
        self.procs[name] = subprocess.Popen(
            self._command(role), env=self._env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
        )

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if name.startswith("worker"):
            self.summary.worker_kills += 1
        else:
            self.summary.relay_kills += 1

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
        _rabbitmqctl("add_vhost", self.vhost)
        _rabbitmqctl("set_permissions", "-p", self.vhost, urlparse(self.args.broker_url).username or "guest",
                     ".*", ".*", ".*")
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            await create_tables(conn, self.schema)
        self.connection = await aio_pika.connect_robust(self.broker_url)
        channel = await self.connection.channel()
        exchange = await channel.declare_exchange(self.events, aio_pika.ExchangeType.TOPIC, durable=True)
        capture = await channel.declare_queue(self.capture, durable=True)
        await capture.bind(exchange, "#")
        await capture.consume(self._on_event)
        self.publish_channel = await self.connection.channel(publisher_confirms=True)

    async def teardown(self) -> None:
        await self.connection.close()
        if not self.args.keep:
            _rabbitmqctl("delete_vhost", self.vhost, check=False)
            async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
                await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))

    async def _on_event(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self.received_ids[message.message_id or "<none>"] += 1
        await message.ack()

    async def _queue_ready(self) -> bool:
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

    async def produce(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        outgoing: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(outgoing))
        n = 0
        while loop.time() < until:
            n += 1
            op = f"op-{n:06d}"
            amount = self.rng.randint(1, 1000)
            amounts = [amount] * self.rng.randint(1, 3)
            if self.rng.random() < 0.05:
                amounts.insert(self.rng.randrange(len(amounts) + 1), amount + 1)
            self.copies[op] = amounts
            outgoing.put_nowait((op, amounts[0]))
            for later in amounts[1:]:
                loop.call_later(self.rng.uniform(0.0, 3.0), outgoing.put_nowait, (op, later))
            await asyncio.sleep(1 / self.args.rate)  # pacing the producer, not synchronisation
        await asyncio.sleep(3.1)  # let the delayed copies of the last operations be queued
        await outgoing.join()
        sender.cancel()

    async def _send(self, outgoing: asyncio.Queue[tuple[str, int]]) -> None:
        while True:
            op, amount = await outgoing.get()
            try:
                await self.publish_channel.default_exchange.publish(
                    aio_pika.Message(
                        command_body(op, amount), message_id=str(uuid.uuid4()),
                        headers={"operation-id": op, "message-type": "ChaosCommand"},
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key=self.queue,
                )
                self.summary.copies_sent += 1
            finally:
                outgoing.task_done()

    async def killer(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        next_pg = loop.time() + self.rng.uniform(4, 8)
        next_amqp = loop.time() + self.rng.uniform(6, 12)
        while loop.time() < until:
            await asyncio.sleep(self.rng.uniform(1.5, 4.0))
            if loop.time() >= until:
                break
            name = self.rng.choice(sorted(self.procs))
            self.kill(name)
            self.start(name)
            if loop.time() >= next_pg:
                await self._terminate_backends()
                next_pg = loop.time() + self.rng.uniform(8, 16)
            if loop.time() >= next_amqp:
                await asyncio.to_thread(self._close_connections)
                next_amqp = loop.time() + self.rng.uniform(10, 20)

    async def _terminate_backends(self) -> None:
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = %s AND pid <> pg_backend_pid()",
                (self.appname,),
            )
            row = await cur.fetchone()
            self.summary.pg_terminations += int(row[0]) if row else 0

    def _close_connections(self) -> None:
        if self.args.close_all:
            _rabbitmqctl("close_all_connections", "chaos")
            self.summary.connection_closes += 1
            return
        out = _rabbitmqctl("list_connections", "pid", "vhost", "client_properties", "--no-table-headers")
        for line in out.splitlines():
            parts = line.split("\t")
            # the run's own producer/capture connection is left alone: it is the observer
            if len(parts) >= 2 and parts[1] == self.vhost and "consumer-kit" in line:
                _rabbitmqctl("close_connection", parts[0], "chaos", check=False)
                self.summary.connection_closes += 1

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
        return all(n == 0 for _, n in await asyncio.to_thread(self._queue_depths))

    def _queue_depths(self) -> list[tuple[str, int]]:
        out = _rabbitmqctl("list_queues", "-p", self.vhost, "name", "messages", "--no-table-headers")
        depths = []
        for line in out.splitlines():
            parts = line.split("\t")
            if len(parts) == 2 and parts[0].startswith(self.queue) and not parts[0].endswith(".dlq"):
                depths.append((parts[0], int(parts[1])))
        return depths

    async def collect_dead_letters(self) -> None:
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

    async def verify(self) -> None:
        s = self.summary
        v = s.violations
        s.operations = len(self.copies)
        s.conflicting_copies = sum(len(set(a)) > 1 for a in self.copies.values())
        async with await psycopg.AsyncConnection.connect(self.database_url, autocommit=True) as conn:
            async def rows(query: str) -> list[tuple[Any, ...]]:
                cur = await conn.execute(
                    sql.SQL(query).format(
                        effects=sql.Identifier(self.schema, "effects"),
                        ops=sql.Identifier(self.schema, "operations"),
                        outbox=sql.Identifier(self.schema, "outbox"),
                        accounts=sql.Identifier(self.schema, "accounts"),
                    )
                )
                return await cur.fetchall()

            effects = await rows("SELECT operation_key, count(*), min(amount) FROM {effects} GROUP BY 1")
            states = dict(await rows("SELECT state, count(*) FROM {ops} GROUP BY 1"))
            outbox = await rows("SELECT event_id::text, published_at IS NOT NULL FROM {outbox}")
            balance = (await rows("SELECT coalesce(sum(balance), 0) FROM {accounts}"))[0][0]
        s.effects = sum(n for _, n, _ in effects)
        winners = {op: amount for op, _, amount in effects}
        for op, n, _ in effects:
            if n != 1:
                v.append(f"{op} has {n} effects")
        missing = set(self.copies) - set(winners)
        if missing:
            v.append(f"{len(missing)} operations without an effect, e.g. {sorted(missing)[:5]}")
        if set(states) - {"completed"}:
            v.append(f"ledger rows not terminal/completed: {states}")
        if states.get("completed", 0) != s.operations:
            v.append(f"{states.get('completed', 0)} completed ledger rows for {s.operations} operations")
        if balance != sum(winners.values()):
            v.append(f"balance {balance} != sum of winning amounts {sum(winners.values())}")
        # every conflicting copy (amount differs from the winner's) dead-lettered, nothing else
        expected_dead = Counter(
            {op: sum(a != winners.get(op) for a in amounts) for op, amounts in self.copies.items() if op in winners}
        )
        expected_dead = +expected_dead
        s.expected_dead_letters = sum(expected_dead.values())
        s.dead_lettered = len(self.dead)
        s.duplicate_dead_letters = self.dead_copies - len(self.dead)
        reasons = Counter(reason for _, reason in self.dead.values())
        if set(reasons) - {"payload_conflict"}:
            v.append(f"unexpected dead-letter reasons: {dict(reasons)}")
        got_dead = Counter(op for op, reason in self.dead.values() if reason == "payload_conflict")
        if got_dead != expected_dead:
            diff = {op: (got_dead[op], expected_dead[op]) for op in set(got_dead) | set(expected_dead)
                    if got_dead[op] != expected_dead[op]}
            v.append(f"dead-letters per operation (got, expected) differ: {dict(list(diff.items())[:10])}")
        # the outbox: one event per effect, each published with its event id as the message id
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
        for name, depth in await asyncio.to_thread(self._queue_depths):
            if depth:
                v.append(f"queue {name} still holds {depth} messages")

    # -- the run ---------------------------------------------------------------------------------

    async def run(self) -> Summary:
        await self.setup()
        try:
            for i in range(WORKERS):
                self.start(f"worker-{i}")
            for i in range(RELAYS):
                self.start(f"relay-{i}")
            async with asyncio.timeout(60):
                while not await self._queue_ready():
                    await asyncio.sleep(0.2)  # waiting for the workers to declare the queue
            loop = asyncio.get_running_loop()
            until = loop.time() + self.args.duration
            await asyncio.gather(self.produce(until), self.killer(until))
            for name, proc in self.procs.items():  # restart anything that died on its own
                if proc.poll() is not None:
                    print(f"{name} exited with {proc.returncode}; restarting", file=sys.stderr)
                    self.start(name)
            started = loop.time()
            try:
                async with asyncio.timeout(self.args.drain_timeout):
                    while not await self.drained():
                        await asyncio.sleep(0.5)  # polling the ledger, outbox and queues
            except TimeoutError:
                self.summary.violations.append(f"did not drain within {self.args.drain_timeout} s")
            self.summary.drain_seconds = loop.time() - started
            await self.collect_dead_letters()
            await self.verify()
        finally:
            self.stop_all()
            await self.teardown()
        return self.summary


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
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument("--database-url", default=os.environ.get("CONSUMER_KIT_TEST_DATABASE_URL", DEFAULT_DATABASE_URL))
    parser.add_argument("--broker-url", default=os.environ.get("CONSUMER_KIT_TEST_BROKER_URL", DEFAULT_BROKER_URL))
    parser.add_argument("--close-all", action="store_true", help="rabbitmqctl close_all_connections (dedicated broker only)")
    parser.add_argument("--keep", action="store_true", help="keep the schema and vhost for inspection")
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
