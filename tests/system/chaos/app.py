"""The app run by the chaos run and the SIGKILL crash tests: one effect per operation, observable.

Each operation ``op`` adds ``amount`` to an account and writes one ``effects`` row *without* a
unique constraint on the key, so a second execution would show up as a second row (the ledger
is the only thing keeping it to one). It also writes one ``ChaosEffected`` event to the outbox.

The account :data:`POISON_ACCOUNT` is poison: its handler kills its own process
(``os._exit(1)``, with the delivery in flight and its transaction open) on every delivery, so the
worker must park it as ``crashed_worker`` after ``crash_limit`` deaths while it ran alone.

Configured by the environment so a worker process (``consumer-kit worker tests.system.chaos.app:app`` or
``python tests/system/chaos/worker_main.py``) needs no arguments:

* ``CONSUMER_KIT_DB_SCHEMA``: schema of the ledger, outbox and these tables (names are qualified
  with it, so no ``search_path`` is needed);
* ``CK_CHAOS_QUEUE``: the command queue; ``CK_CHAOS_EVENTS``: the events exchange;
* ``CK_CHAOS_BATCH``: ``batch_size`` of the handler (default 1: no batches; above 1 the worker
  runs the batch path, docs/how-to/batches.md).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import Any, ClassVar

from psycopg import AsyncConnection, sql
from pydantic import BaseModel

from consumer_kit import App, Context, Handler, Result
from consumer_kit.ledger import migrate

QUEUE_PREFIX = "ck-chaos"
SCHEMA = os.environ.get("CONSUMER_KIT_DB_SCHEMA", "consumer_kit")
QUEUE = os.environ.get("CK_CHAOS_QUEUE", f"{QUEUE_PREFIX}.commands")
EVENTS = os.environ.get("CK_CHAOS_EVENTS", f"{QUEUE_PREFIX}.events")
POISON_ACCOUNT = "poison"
BATCH = int(os.environ.get("CK_CHAOS_BATCH", "1"))


class ChaosCommand(BaseModel):
    account: str
    amount: int
    sent_at: dt.datetime


class ChaosEffected(BaseModel):
    operation_key: str
    account: str
    amount: int


class ChaosHandler(Handler[ChaosCommand]):
    operation_type = "chaos.apply"
    fingerprint_exclude: ClassVar[Any] = frozenset({"sent_at"})

    def __init__(self, schema: str = SCHEMA, events: str = EVENTS) -> None:
        super().__init__()
        self._insert = sql.SQL(
            "INSERT INTO {} (operation_key, account, amount, pid) VALUES (%s, %s, %s, pg_backend_pid())"
        ).format(sql.Identifier(schema, "effects"))
        self._add = sql.SQL(
            "INSERT INTO {t} AS a (account, balance) VALUES (%s, %s) "
            "ON CONFLICT (account) DO UPDATE SET balance = a.balance + EXCLUDED.balance"
        ).format(t=sql.Identifier(schema, "accounts"))
        self._events = events

    async def handle(self, message: ChaosCommand, ctx: Context) -> Result:
        key = ctx.operation.key
        if message.account == POISON_ACCOUNT:
            # Dies as a segfaulting library would: no exception, no rollback, no settlement.
            os.write(2, f"chaos app: poison operation {key}: the process exits\n".encode())
            os._exit(1)
        await ctx.connection.execute(self._insert, (key, message.account, message.amount))
        await ctx.connection.execute(self._add, (message.account, message.amount))
        event_id = await ctx.publish(
            ChaosEffected(operation_key=key, account=message.account, amount=message.amount),
            destination=self._events, routing_key="effected", partition_key=message.account,
        )
        return Result(status="applied", reference=str(event_id))


TABLES_SQL = """
CREATE TABLE IF NOT EXISTS {effects} (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_key text   NOT NULL,
    account       text   NOT NULL,
    amount        bigint NOT NULL,
    pid           integer,
    created_at    timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {accounts} (
    account text PRIMARY KEY,
    balance bigint NOT NULL
);
"""


async def create_tables(conn: AsyncConnection[Any], schema: str) -> None:
    """Ledger, outbox and the app's tables in ``schema`` (idempotent)."""
    await migrate(conn, schema)
    await conn.execute(
        sql.SQL(TABLES_SQL).format(
            effects=sql.Identifier(schema, "effects"), accounts=sql.Identifier(schema, "accounts")
        )
    )


def command_body(op: str, amount: int, account: str = "acct-1") -> bytes:
    """A JSON command body; ``sent_at`` changes on every call (volatile, excluded)."""
    return json.dumps(
        {"account": account, "amount": amount, "sent_at": dt.datetime.now(dt.UTC).isoformat()}
    ).encode()


class ChaosBatchHandler(ChaosHandler):
    """The same effect on the batch path (``handle`` per item, in one transaction per batch)."""

    batch_size = max(BATCH, 2)
    batch_wait = 0.02


app = App("chaos")
app.subscribe(QUEUE, ChaosBatchHandler() if BATCH > 1 else ChaosHandler())
