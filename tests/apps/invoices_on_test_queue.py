"""The invoices example bound to the queue named by ``CK_TEST_QUEUE``, for worker subprocesses."""

from __future__ import annotations

import os

from consumer_kit import App
from examples.invoices.app import CreateInvoiceHandler

app = App("invoices-test")
app.subscribe(os.environ["CK_TEST_QUEUE"], CreateInvoiceHandler())
