"""Send ``CreateInvoice`` commands to ``invoices.commands`` on RabbitMQ (the queue must exist:
``consumer-kit declare consumer_kit.demo.app:app`` creates it, as a worker does at start).

    python -m consumer_kit.demo.send --order-id 418 --revision 2 --customer c-1 --amount 1250 --times 3

Each copy gets its own broker message id, as a producer retrying after a timeout would send it:
only the operation key (derived from order id and revision) says they are one operation.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Annotated

import typer

from consumer_kit import ConfigurationError, OutgoingMessage, PublishError, Settings
from consumer_kit.adapters.rabbitmq import RabbitMQPublisher
from consumer_kit.cli.console import fail, read_settings, require_shared_broker, setup_logging
from consumer_kit.codec.redaction import redact_url

from .app import CreateInvoice

QUEUE = "invoices.commands"


def main(
    order_id: Annotated[int, typer.Option()],
    customer: Annotated[str, typer.Option()],
    amount: Annotated[int, typer.Option(help="Amount in cents")],
    revision: Annotated[int, typer.Option()] = 1,
    currency: Annotated[str, typer.Option()] = "EUR",
    times: Annotated[int, typer.Option(min=1, help="Send the same command this many times")] = 1,
) -> None:
    """Publish the command ``times`` times with publisher confirms."""
    setup_logging("WARNING", "CRITICAL")  # the error below says why; no library tracebacks
    settings = read_settings(Settings)
    try:
        require_shared_broker(settings, "consumer_kit.demo.send")
    except ConfigurationError as exc:
        fail(str(exc))
    if not settings.broker_url.startswith(("amqp://", "amqps://")):
        fail(
            f"consumer_kit.demo.send publishes to RabbitMQ only, and CONSUMER_KIT_BROKER_URL is "
            f"{redact_url(settings.broker_url)}: on SQS or Service Bus send the command as "
            "examples/invoices/README.md shows"
        )

    async def send() -> None:
        publisher = RabbitMQPublisher(settings.broker_url)
        try:
            await publisher.connect(within=0)  # down is down: say so at once
            for _ in range(times):
                command = CreateInvoice(
                    order_id=order_id, revision=revision, customer_id=customer, amount_cents=amount,
                    currency=currency, requested_at=dt.datetime.now(dt.UTC),
                )
                await publisher.publish(
                    OutgoingMessage(
                        destination="", routing_key=QUEUE, message_id=str(uuid.uuid4()),
                        body=command.model_dump_json().encode(), message_type="CreateInvoice",
                    )
                )
        finally:
            await publisher.close()
        typer.echo(f"sent {times} x order {order_id} revision {revision} to {QUEUE}")

    try:
        asyncio.run(send())
    except ConnectionError as exc:  # the broker is down or refuses: names the URL, password redacted
        fail(f"{exc}; is RabbitMQ running and CONSUMER_KIT_BROKER_URL right?")
    except PublishError as exc:
        if exc.transient or exc.permanent:
            fail(str(exc))
        fail(f"{exc}: create it with `consumer-kit declare consumer_kit.demo.app:app` (or start the worker)")


if __name__ == "__main__":
    typer.run(main)
