"""Copy this file next to your own handler's tests: every delivery guarantee in a few lines.

Run it with ``pytest examples/testing_kit`` (``pip install -e '/path/to/consumer-kit[testing]'`` brings pytest
and pytest-asyncio; the kit's plugin runs these ``async def`` tests without a marker). The database is
``CONSUMER_KIT_TEST_DATABASE_URL`` or ``CONSUMER_KIT_DATABASE_URL``; with neither set, the kit
starts an embedded PostgreSQL for the session. Each harness works in a throwaway schema.
"""

from __future__ import annotations

import pytest

from consumer_kit.demo.app import SCHEMA_SQL, CreateInvoiceHandler
from consumer_kit.testing import CrashPoint

ORDER = {
    "order_id": 418, "revision": 2, "customer_id": "c-1", "amount_cents": 1250,
    "currency": "EUR", "requested_at": "2024-05-01T10:00:00Z",
}


async def test_a_duplicate_storm_has_one_effect(consumer_kit_harness) -> None:
    async with consumer_kit_harness(CreateInvoiceHandler(), setup_sql=SCHEMA_SQL) as kit:
        await kit.deliver(ORDER, times=5, concurrently=True)
        kit.assert_outcomes({"executed": 1, "duplicate": 4})
        await kit.assert_one_effect("SELECT count(*) FROM invoices WHERE order_id = %s", 418)
        assert await kit.fetchval("SELECT invoiced_cents FROM customers") == 1250


@pytest.mark.parametrize("point", [p.value for p in CrashPoint if p.value in (
    "before_claim", "after_claim", "in_handler", "after_commit_before_ack", "before_ack")])
async def test_a_crash_at_any_boundary_has_one_effect(consumer_kit_harness, point: str) -> None:
    async with consumer_kit_harness(CreateInvoiceHandler(), setup_sql=SCHEMA_SQL) as kit:
        kit.crash_at(point)  # the first delivery "dies" there; the broker redelivers it
        await kit.deliver(ORDER)
        assert kit.outcomes()["crashed"] == 1  # then executed, or a duplicate after COMMIT
        await kit.assert_one_effect("SELECT count(*) FROM invoices")


async def test_a_changed_payload_under_the_same_key_is_refused(consumer_kit_harness) -> None:
    async with consumer_kit_harness(CreateInvoiceHandler(), setup_sql=SCHEMA_SQL) as kit:
        await kit.deliver(ORDER)
        await kit.deliver({**ORDER, "amount_cents": 9999})
        await kit.deliver({**ORDER, "requested_at": "2030-01-01T00:00:00Z"})  # volatile field
        kit.assert_outcomes({"executed": 1, "payload_conflict": 1, "duplicate": 1})
        assert [reason for reason, _ in kit.dead_letters()] == ["payload_conflict"]
        await kit.replay_all()  # redeliver everything once more: still one invoice
        await kit.assert_one_effect("SELECT count(*) FROM invoices")


async def test_a_business_failure_is_recorded_once_and_replayed(consumer_kit_harness) -> None:
    async with consumer_kit_harness(CreateInvoiceHandler(), setup_sql=SCHEMA_SQL) as kit:
        await kit.deliver({**ORDER, "amount_cents": -1}, times=3, concurrently=False)
        kit.assert_outcomes({"failed": 1, "failed_retained": 2})
        await kit.assert_one_effect("SELECT count(*) FROM invoices", expected=0)
