"""The invoices example on the batch path (docs/how-to/batches.md).

:class:`BatchCreateInvoiceHandler` is :class:`~consumer_kit.demo.app.CreateInvoiceHandler` taking up
to 50 deliveries per transaction. Its ``handle_batch`` writes the effects of all new operations of a
batch with one statement per table (``unnest``), the customers' increments summed per customer and
in customer order (two batches that touch the same customers lock them in the same order and never
deadlock); each item publishes its own event. ``handle`` (inherited) stays the effect of one
operation: the batch path runs it for an item on its own (a redelivery, a retry) and, item by item,
when ``handle_batch`` raises.
"""

from __future__ import annotations

from collections.abc import Sequence

from consumer_kit import Context, PermanentFailure, Result

from .app import CreateInvoice, CreateInvoiceHandler, InvoiceCreated

INSERT_INVOICES = (
    "INSERT INTO invoices (order_id, revision, customer_id, amount_cents, currency) "
    "SELECT * FROM unnest(%s::bigint[], %s::int[], %s::text[], %s::bigint[], %s::text[]) "
    "RETURNING invoice_id, order_id, revision"
)
ADD_TO_CUSTOMERS = (
    "INSERT INTO customers AS c (customer_id, invoiced_cents) "
    "SELECT customer_id, sum(amount) FROM unnest(%s::text[], %s::bigint[]) AS t(customer_id, amount) "
    "GROUP BY customer_id ORDER BY customer_id "
    "ON CONFLICT (customer_id) DO UPDATE SET invoiced_cents = c.invoiced_cents + EXCLUDED.invoiced_cents"
)


class BatchCreateInvoiceHandler(CreateInvoiceHandler):
    batch_size = 50
    batch_wait = 0.005  # seconds

    async def handle_batch(self, batch: Sequence[tuple[CreateInvoice, Context]]) -> list[Result]:
        if any(message.amount_cents < 0 for message, _ in batch):
            # handle() says which one: the batch runs again item by item
            raise PermanentFailure("negative_amount", "an invoice amount cannot be negative")
        messages = [message for message, _ in batch]
        conn = batch[0][1].connection
        cur = await conn.execute(INSERT_INVOICES, (
            [m.order_id for m in messages], [m.revision for m in messages], [m.customer_id for m in messages],
            [m.amount_cents for m in messages], [m.currency for m in messages],
        ))
        ids: dict[tuple[int, int], list[int]] = {}
        for invoice_id, order_id, revision in await cur.fetchall():
            ids.setdefault((order_id, revision), []).append(invoice_id)
        await conn.execute(ADD_TO_CUSTOMERS, ([m.customer_id for m in messages], [m.amount_cents for m in messages]))
        results = []
        for message, ctx in batch:
            invoice_id = ids[message.order_id, message.revision].pop(0)
            await ctx.publish(
                InvoiceCreated(
                    invoice_id=invoice_id, order_id=message.order_id, revision=message.revision,
                    customer_id=message.customer_id, amount_cents=message.amount_cents,
                ),
                destination="billing.events", routing_key="invoice.created", partition_key=message.customer_id,
            )
            results.append(Result(status="created", reference=str(invoice_id)))
        return results
