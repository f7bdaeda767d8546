"""consumer-kit: one business effect per operation on at-least-once queues.

The public API is re-exported here; see docs/tutorial.md for a walkthrough.
"""

from importlib.metadata import version as _distribution_version

from consumer_kit._checkout import map_folders
from consumer_kit.app import App, load_app
from consumer_kit.broker import Consumer, Delivery, Settlement
from consumer_kit.broker.publishing import OutgoingMessage, Publisher
from consumer_kit.codec.envelope import Envelope
from consumer_kit.context import Context
from consumer_kit.effects import Evidence, Reconciled
from consumer_kit.errors import (
    ConfigurationError,
    ConsumerKitError,
    ContextSealed,
    DeadLetterReason,
    InvalidMessage,
    LeaseLost,
    PermanentFailure,
    PublishError,
    RetryableError,
    StaleVersion,
)
from consumer_kit.handler import Handler
from consumer_kit.identity import canonical_json, fingerprint
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.outcomes import DeliveryReport, Outcome
from consumer_kit.model.results import Result, StoredResult
from consumer_kit.outbox import OutboxWriter
from consumer_kit.settings import Settings
from consumer_kit.versions import apply_if_newer, update_expecting

__version__ = _distribution_version("consumer-kit")
"""The installed version: pyproject.toml's ``[project] version``, the one place it is written
(docs/development.md, "Releasing")."""

map_folders()  # from a source checkout: adapters/, outbox_relay/, examples/invoices/ by their installed names

__all__ = [
    "App",
    "ConfigurationError",
    "Consumer",
    "ConsumerKitError",
    "ContextSealed",
    "Context",
    "DeadLetterReason",
    "Delivery",
    "DeliveryReport",
    "Envelope",
    "Evidence",
    "Handler",
    "InvalidMessage",
    "LeaseLost",
    "OperationIdentity",
    "Outcome",
    "OutboxWriter",
    "OutgoingMessage",
    "PermanentFailure",
    "PublishError",
    "Reconciled",
    "Publisher",
    "Result",
    "RetryableError",
    "Settings",
    "Settlement",
    "StaleVersion",
    "StoredResult",
    "apply_if_newer",
    "canonical_json",
    "fingerprint",
    "load_app",
    "update_expecting",
]
