"""The README's first handler and its test run as written, and the tutorial builds the same files.

The README shows ``invoicing.py`` whole (section "A first handler") and ``test_invoicing.py``
(section "Testing it"); docs/tutorial.md builds ``invoicing.py`` in pieces (code blocks titled
``invoicing.py``) and shows ``test_invoicing.py`` again. Both must be the same code, and it must do
what the pages say: one effect for several deliveries, a crash after COMMIT answered as a duplicate.
"""

from __future__ import annotations

import json
import re
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from consumer_kit import App, Outcome
from consumer_kit.adapters.memory import MemoryBroker, MemoryConsumer
from tests.fixtures.harness import fetch_all, runtime_for, throwaway_schema

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text()


def section_code(text: str, heading: str) -> str:
    """The first ```python block under ``## heading``."""
    code = re.search(rf"^## {re.escape(heading)}\n.*?```python\n(.*?)```", text, re.S | re.M)
    assert code, f"README lost the code of its section {heading!r}"
    return code.group(1)


def titled_blocks(text: str, title: str) -> str:
    """Every ```python title="..." block of that file, joined as the tutorial builds it."""
    blocks = re.findall(rf'```python title="{re.escape(title)}"\n(.*?)```', text, re.S)
    assert blocks, f"docs/tutorial.md has no code block titled {title}"
    return "\n\n".join(block.strip("\n") for block in blocks) + "\n"


def normalised(code: str) -> str:
    return re.sub(r"\n{2,}", "\n\n", code.strip()) + "\n"


def load_module(name: str, code: str, origin: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # pydantic resolves annotations through the module; tests import it
    exec(compile(code, origin, "exec"), module.__dict__)
    return module


@pytest.fixture
def invoicing() -> Iterator[types.ModuleType]:
    module = load_module("invoicing", section_code(README, "A first handler"), "README.md")
    yield module
    sys.modules.pop("invoicing", None)


def test_the_tutorial_builds_the_readme_files() -> None:
    assert normalised(titled_blocks(TUTORIAL, "invoicing.py")) == normalised(section_code(README, "A first handler"))
    assert normalised(titled_blocks(TUTORIAL, "test_invoicing.py")) == normalised(section_code(README, "Testing it"))


async def test_readme_handler_has_one_effect(database_url: str, invoicing: types.ModuleType) -> None:
    app: App = invoicing.app
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


def readme_tests(invoicing: types.ModuleType) -> dict[str, Callable[..., Any]]:
    module = load_module("test_invoicing", section_code(README, "Testing it"), "README.md (test_invoicing.py)")
    tests = {name: value for name, value in vars(module).items() if name.startswith("test_")}
    assert len(tests) == 2, sorted(tests)
    return tests


async def test_readme_test_of_a_duplicate_storm_passes(invoicing: types.ModuleType, consumer_kit_harness: Any) -> None:
    await readme_tests(invoicing)["test_five_copies_make_one_invoice"](consumer_kit_harness)


async def test_readme_test_of_a_crash_after_commit_passes(invoicing: types.ModuleType, consumer_kit_harness: Any) -> None:
    await readme_tests(invoicing)["test_a_crash_between_commit_and_ack_is_answered_as_a_duplicate"](consumer_kit_harness)
