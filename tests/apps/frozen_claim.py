"""One delivery of the invoices command through a real :class:`Runtime` whose handler, after its
writes, waits inside the transaction until the process gets ``SIGCONT`` (or its handler timeout):
``python -m tests.apps.frozen_claim DATABASE_URL SCHEMA MESSAGE_ID MARKER``.

It writes its backend pid to ``MARKER`` once the writes are done (the moment to SIGSTOP it) and
prints the delivery's outcome as one JSON line when it ends. tests/test_frozen_process.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from consumer_kit import App, Context, Result, Settings
from consumer_kit.adapters.memory import MemoryBroker, MemoryDelivery
from consumer_kit.pipeline.runtime import Runtime, open_pool
from examples.invoices.app import CreateInvoice, CreateInvoiceHandler
from tests.broker_env import command

QUEUE = "invoices.commands"
HANDLER_TIMEOUT = 5.0  # seconds: also the idle-in-transaction bound of this process


class WaitsForSigcont(CreateInvoiceHandler):
    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.marker = marker

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        result = await super().handle(message, ctx)  # the invoice, the balance, the outbox row
        cur = await ctx.connection.execute("SELECT pg_backend_pid()")
        row = await cur.fetchone()
        woken = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGCONT, woken.set)
        self.marker.write_text(str(row[0] if row else 0))
        await woken.wait()  # frozen here, idle in its transaction
        return result


async def main(database_url: str, schema: str, message_id: str, marker: Path) -> None:
    settings = Settings(
        database_url=database_url, db_schema=schema, search_path=schema, handler_timeout=HANDLER_TIMEOUT,
        idle_in_transaction_timeout=HANDLER_TIMEOUT, lock_timeout=0.5, statement_timeout=5.0,
        max_deliveries=5, retry_delays=[0.1],
    )
    app = App("frozen")
    app.subscribe(QUEUE, WaitsForSigcont(marker))
    pool = await open_pool(settings, database_url, search_path=schema)
    try:
        broker = MemoryBroker(lock_timeout=600)
        broker.send(QUEUE, command(order_id=7), message_id=message_id)
        delivery = MemoryDelivery(broker, QUEUE, broker.queue(QUEUE).ready.popleft())
        report = await Runtime(app, pool, settings).process(delivery)
    finally:
        await pool.close()
    print(json.dumps({"outcome": report.outcome.value, "settlement": getattr(report.settlement, "value", None)}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])))
