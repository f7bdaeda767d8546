"""The invoices example: one command, one transaction, one event.

``CreateInvoice`` arrives on queue ``invoices.commands``. In one transaction the handler inserts an
invoice, adds the amount to the customer's balance (an increment: not idempotent by itself; the
ledger is what keeps it to one) and writes ``InvoiceCreated`` to the outbox for ``billing.events``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, ClassVar

from psycopg import AsyncConnection
from pydantic import BaseModel, Field

from consumer_kit import App, Context, Envelope, Handler, PermanentFailure, Result

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS invoices (
    invoice_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id     bigint NOT NULL,
    revision     integer NOT NULL,
    customer_id  text NOT NULL,
    amount_cents bigint NOT NULL,
    currency     text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS customers (
    customer_id    text PRIMARY KEY,
    invoiced_cents bigint NOT NULL DEFAULT 0
);
"""


class CreateInvoice(BaseModel):
    order_id: int
    revision: int
    customer_id: str = Field(min_length=1, max_length=100)
    amount_cents: int
    currency: str = Field(min_length=3, max_length=3)
    requested_at: dt.datetime


class InvoiceCreated(BaseModel):
    invoice_id: int
    order_id: int
    revision: int
    customer_id: str
    amount_cents: int


class CreateInvoiceHandler(Handler[CreateInvoice]):
    operation_type = "invoice.create"
    fingerprint_exclude: ClassVar[set[str]] = {"requested_at"}  # a resend's new timestamp is not a new intent

    def operation_key(self, message: CreateInvoice, envelope: Envelope) -> str:
        # A command from the HTTP front door (api.py) carries its Idempotency-Key as header
        # operation-id: the same operation, one key end to end. Others: from the body.
        from_header = envelope.operation_id
        if isinstance(from_header, str) and from_header:
            return from_header
        return f"order-{message.order_id}-rev-{message.revision}"

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        if message.amount_cents < 0:
            raise PermanentFailure("negative_amount", "an invoice amount cannot be negative")
        conn = ctx.connection
        cur = await conn.execute(
            "INSERT INTO invoices (order_id, revision, customer_id, amount_cents, currency) "
            "VALUES (%s, %s, %s, %s, %s) RETURNING invoice_id",
            (message.order_id, message.revision, message.customer_id, message.amount_cents, message.currency),
        )
        row = await cur.fetchone()
        assert row is not None
        invoice_id = int(row[0])
        await conn.execute(
            "INSERT INTO customers (customer_id, invoiced_cents) VALUES (%s, %s) "
            "ON CONFLICT (customer_id) DO UPDATE "
            "SET invoiced_cents = customers.invoiced_cents + EXCLUDED.invoiced_cents",
            (message.customer_id, message.amount_cents),
        )
        await ctx.publish(
            InvoiceCreated(
                invoice_id=invoice_id,
                order_id=message.order_id,
                revision=message.revision,
                customer_id=message.customer_id,
                amount_cents=message.amount_cents,
            ),
            destination="billing.events",
            routing_key="invoice.created",
            partition_key=message.customer_id,
        )
        return Result(status="created", reference=str(invoice_id))


async def create_tables(conn: AsyncConnection[Any]) -> None:
    """Create the example's own tables (idempotent)."""
    await conn.execute(SCHEMA_SQL)


app = App("invoices", events=["billing.events"])  # `consumer-kit declare` creates the exchange
app.subscribe("invoices.commands", CreateInvoiceHandler())
app.event(InvoiceCreated, destination="billing.events", routing_key="invoice.created")  # the contract's event
app.on_startup(create_tables)
