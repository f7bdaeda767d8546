"""Send CreateInvoice to the invoices example with aio-pika alone: no consumer-kit import, so it
shows what a producer in any language sends (docs/brokers/rabbitmq.md, "Send commands from any producer").

    python examples/invoices/plain_producer.py amqp://guest:guest@127.0.0.1:5672/ 418 2
"""

import asyncio
import datetime as dt
import json
import sys
import uuid

import aio_pika


async def send_create_invoice(url: str, order_id: int, revision: int, queue: str = "invoices.commands") -> None:
    body = {
        "order_id": order_id, "revision": revision, "customer_id": "c-1", "amount_cents": 1250,
        "currency": "EUR", "requested_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    message = aio_pika.Message(
        body=json.dumps(body).encode(),            # JSON (RFC 8259: no NaN or Infinity)
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=str(uuid.uuid4()),              # any id: a resend may carry a new one
        correlation_id=f"checkout-{order_id}",     # copied to the events the handler publishes
        headers={
            "operation-id": f"order-{order_id}-rev-{revision}",  # the same on every resend
            "tenant-id": "default",
            "message-type": "CreateInvoice",
        },
    )
    connection = await aio_pika.connect(url)
    async with connection:
        # Confirms: publish() returns once the broker has the message; on_return_raises: a
        # missing queue is an error here instead of a message dropped silently.
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.default_exchange.publish(message, routing_key=queue, mandatory=True)


if __name__ == "__main__":
    asyncio.run(send_create_invoice(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5]))
