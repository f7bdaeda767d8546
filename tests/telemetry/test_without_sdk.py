"""Without an OpenTelemetry SDK no span is started (nothing would record it), and the producer's
trace context still reaches the events a handler publishes (docs/operations/monitoring.md).

In a process of its own: the test session installs the SDK for the other telemetry tests, and a
tracer provider can be set once per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.harness import fetch_all, throwaway_schema

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parents[2]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"

SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from opentelemetry import trace
    from consumer_kit import App
    from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
    from consumer_kit.demo.app import CreateInvoiceHandler
    from consumer_kit.telemetry.tracing import tracing_enabled
    from tests.fixtures.broker_env import command
    from tests.fixtures.harness import runtime_for

    async def main(url, schema, traceparent):
        assert not tracing_enabled()
        app = App("no-sdk")
        app.subscribe("q", CreateInvoiceHandler())
        outcomes, spans = [], []
        async with runtime_for(app, url, schema) as rt:
            broker = MemoryBroker()
            broker.send("q", command(order_id=1), headers={"traceparent": traceparent})
            broker.send("q", command(order_id=2))
            done = asyncio.Event()

            async def on_delivery(delivery):
                report = await rt.process(delivery)
                outcomes.append(report.outcome.value)
                spans.append(trace.get_current_span() is trace.INVALID_SPAN)  # nothing left current
                if len(outcomes) == 2:
                    done.set()

            consumer = MemoryConsumer(broker)
            await consumer.subscribe("q", on_delivery, prefetch=1)
            await asyncio.wait_for(done.wait(), 15)
            await consumer.close()
        print(json.dumps({"outcomes": outcomes, "nothing_current": spans}))

    asyncio.run(main(*sys.argv[1:]))
""")


async def test_the_producers_trace_reaches_the_events_without_an_sdk(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, database_url, schema, PRODUCER],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result == {"outcomes": ["executed", "executed"], "nothing_current": [True, True]}
        rows = await fetch_all(database_url, schema, "SELECT operation_key, headers FROM outbox ORDER BY id")
    headers = {key: stored for key, stored in rows}
    # the producer's trace context, as it came: the relay's publish span continues that trace
    assert headers["order-1-rev-2"] == {"traceparent": PRODUCER}
    assert headers["order-2-rev-2"] == {}  # no producer context, no SDK: nothing to carry
