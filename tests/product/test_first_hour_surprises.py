"""First-hour surprises, each as a newcomer meets it."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import pytest
from typer.testing import CliRunner

from consumer_kit.cli.console import setup_logging
from consumer_kit.cli.main import cli
from consumer_kit.demo.app import SCHEMA_SQL, CreateInvoiceHandler
from consumer_kit.testing import Harness

ORDER = {"order_id": 7, "revision": 1, "customer_id": "c-7", "amount_cents": 700, "currency": "EUR",
         "requested_at": "2026-01-01T00:00:00Z"}


def invoke(*args: str, **env: str) -> tuple[int, str, str]:
    clean = {k: None for k in os.environ if k.startswith("CONSUMER_KIT_")}
    result = CliRunner().invoke(cli, list(args), env={**clean, "COLUMNS": "80", **env})
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("argv, program", [
    (["stats"], "consumer-kit stats"),
    (["ledger", "list"], "consumer-kit ledger list"),
    (["ledger", "show", "default/x/v1", "k"], "consumer-kit ledger show"),
])
def test_each_command_without_a_database_names_itself(argv: list[str], program: str) -> None:
    code, _, stderr = invoke(*argv)
    assert code == 2
    assert stderr.startswith(f"error: {program} needs a database: set CONSUMER_KIT_DATABASE_URL")


@pytest.mark.postgres
async def test_ledger_list_shows_every_state_by_default_and_says_so(database_url: str) -> None:
    async with Harness(CreateInvoiceHandler(), database_url=database_url, setup_sql=SCHEMA_SQL) as kit:
        await kit.deliver(ORDER)
        env = {"CONSUMER_KIT_DATABASE_URL": database_url, "CONSUMER_KIT_DB_SCHEMA": kit.schema}
        code, listed, _ = await asyncio.to_thread(invoke, "ledger", "list", **env)
        assert code == 0, listed
        assert "all states (processing, completed, failed, needs_reconciliation)" in " ".join(listed.split())
        assert "order-7-rev-1" in listed and "completed" in listed  # a good run is not an empty table
        code, parked, _ = await asyncio.to_thread(invoke, "ledger", "list", "--state", "needs_reconciliation", **env)
        assert code == 0
        assert "state needs_reconciliation" in parked and "(0)" in parked
        assert "no operation in state needs_reconciliation; `consumer-kit ledger list` shows every state" in parked
        code, _, stderr = invoke("ledger", "list", "--state", "done", **env)
        assert code == 2 and "must be all or one of processing" in stderr


@pytest.mark.postgres
async def test_the_delivery_log_line_names_the_field_of_a_schema_mismatch(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The field was only in `dlq list`; every dead-letter reason's detail is now on the line."""
    setup_logging("INFO")
    async with Harness(CreateInvoiceHandler(), database_url=database_url, setup_sql=SCHEMA_SQL) as kit:
        with caplog.at_level(logging.INFO, logger="consumer_kit.runtime"):
            await kit.deliver({**ORDER, "amount_cents": "seven hundred"})
            await kit.deliver({**ORDER, "order_id": 8, "currency": "EURO"})
            await kit.deliver(b"{not json")
    lines = [r for r in caplog.records if r.name == "consumer_kit.runtime" and "outcome=invalid" in r.getMessage()]
    assert len(lines) == 3
    first, second, third = (r.getMessage() for r in lines)
    assert 'reason=schema_mismatch detail="amount_cents: int_parsing"' in first
    assert "seven hundred" not in first  # the field and the error type, never the value
    assert 'reason=schema_mismatch detail="currency: string_too_long"' in second
    assert "reason=invalid_json detail=\"" in third
    fields = lines[0].consumer_kit_fields  # type: ignore[attr-defined]
    assert fields["detail"] == "amount_cents: int_parsing"
    assert json.dumps(fields)  # the JSON line carries it too


def test_at_80_columns_dlq_detail_and_stats_operation_types_are_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """A newcomer saw `dlq list` fold its detail every 8 characters and `stats` cut operation types:
    at 80 columns both print one block per record, values whole (the same print_records)."""
    from consumer_kit.cli.console import Field, output, print_records
    from consumer_kit.cli.stats import COLUMNS

    console = output()
    console.width = 80
    detail = "amount_cents: int_parsing; currency: string_too_long"
    print_records("dead letters of invoices.commands (1)",
                  [Field("message id", 16), Field("operation key", 16), Field("reason", 16), Field("detail", 20),
                   Field("deliveries", 10, "right"), Field("first failure", 10), Field("last failure", 10)],
                  [("m-1", "order-7-rev-1", "schema_mismatch", detail, 3, "12:00:00", "12:00:05")], console)
    operation_type = "billing.invoice.create.with.a.long.name"
    print_records("operations", (Field("operation type", 16), *(Field(t, 6, "right") for _, t in COLUMNS)),
                  [(operation_type, *range(len(COLUMNS)))], console)
    printed = capsys.readouterr().out
    assert detail in printed and operation_type in printed  # each on one line, not folded or cut
    assert max(len(line) for line in printed.splitlines()) <= 80
