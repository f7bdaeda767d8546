"""The README's 30-second handler runs as written: one effect for three deliveries."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

from consumer_kit import App, Outcome
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from tests.harness import fetch_all, runtime_for, throwaway_schema

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def load_readme_module() -> types.ModuleType:
    code = re.search(r"## A handler in 30 seconds\n\n```python\n(.*?)```", README, re.S)
    assert code, "README lost its handler example"
    module = types.ModuleType("invoicing")
    sys.modules["invoicing"] = module  # pydantic resolves annotations through the module
    exec(compile(code.group(1), "README.md", "exec"), module.__dict__)
    return module


async def test_readme_handler_has_one_effect(database_url: str) -> None:
    module = load_readme_module()
    app: App = module.app
    async with throwaway_schema(database_url, example_tables=False) as schema, runtime_for(app, database_url, schema) as rt:
        async with rt.pool.connection() as conn:
            for hook in app.startup:
                await hook(conn)
        broker = MemoryBroker()
        body = {"order_id": 7, "customer_id": "c", "amount_cents": 5, "requested_at": "2026-01-01T00:00:00Z"}
        for _ in range(3):
            broker.send("invoices.commands", json.dumps(body).encode())
        reports = []

        async def on_delivery(delivery):
            reports.append(await rt.process(delivery))

        consumer = MemoryConsumer(broker)
        await consumer.subscribe("invoices.commands", on_delivery, prefetch=1)
        await broker.wait_idle(20)
        await consumer.close()
        assert [r.outcome for r in reports] == [Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.DUPLICATE]
        assert await fetch_all(database_url, schema, "SELECT order_id, amount_cents FROM invoices") == [(7, 5)]
        assert len(await fetch_all(database_url, schema, "SELECT event_id FROM outbox")) == 1
