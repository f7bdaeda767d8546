"""The operator's console: a small server-rendered web application (Starlette, Jinja2, htmx served
as a static file) over the same operator actions as the CLI (:mod:`consumer_kit.ops.operator_actions`).

Pages: Needs a decision (parked operations, resolve them), Dead letters (grouped by reason,
redrive a group or one message after a dry run), Pressure (the ledger and the outbox, last hour),
Audit. Serve it with ``consumer-kit console module:app`` (docs/how-to/console.md). Needs the
``console`` extra.
"""

from consumer_kit.console_web.app import ConsoleConfig, create_app

__all__ = ["ConsoleConfig", "create_app"]
