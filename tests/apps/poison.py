"""The invoices example on the queue named by ``CK_TEST_QUEUE``, except that a command for customer
``poison`` kills its own process (``os._exit``): a message that crashes every worker it reaches."""

from __future__ import annotations

import os

from consumer_kit import App, Context, Result
from examples.invoices.app import CreateInvoice, CreateInvoiceHandler


class PoisonableInvoiceHandler(CreateInvoiceHandler):
    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        if message.customer_id == "poison":
            os._exit(1)  # no cleanup, no rollback message, no ack: as a segfault or an OOM kill would
        return await super().handle(message, ctx)


app = App("poison-test")
app.subscribe(os.environ["CK_TEST_QUEUE"], PoisonableInvoiceHandler())
