"""The notifications example bound to the queue named by ``CK_TEST_QUEUE`` (the provider from
``PROVIDER_URL``), for worker subprocesses."""

from __future__ import annotations

import os

from consumer_kit import App
from examples.notifications.app import WelcomeEmailHandler, create_tables

app = App("notifications-test")
app.subscribe(os.environ["CK_TEST_QUEUE"], WelcomeEmailHandler())
app.on_startup(create_tables)
