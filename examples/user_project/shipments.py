"""A user's handler: book a shipment once per order, and announce it through the outbox.

``ShipOrder`` arrives on queue ``shipments.commands``; in one transaction the handler inserts a
shipment and writes ``ShipmentBooked`` for destination ``shipping.events``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from consumer_kit import App, Context, Envelope, Handler, PermanentFailure, Result

TABLES = """
CREATE TABLE IF NOT EXISTS shipments (
    shipment_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    order_id    text NOT NULL,
    parcels     integer NOT NULL
);
"""


class ShipOrder(BaseModel):
    order_id: str = Field(min_length=1, max_length=64)
    parcels: int


class ShipmentBooked(BaseModel):
    shipment_id: int
    order_id: str
    parcels: int


class ShipOrderHandler(Handler[ShipOrder]):
    operation_type = "shipment.book"

    def operation_key(self, message: ShipOrder, envelope: Envelope) -> str:
        return f"order-{message.order_id}"

    async def handle(self, message: ShipOrder, ctx: Context) -> Result:
        if message.parcels < 1:
            raise PermanentFailure("no_parcels", "a shipment needs at least one parcel")
        cur = await ctx.connection.execute(
            "INSERT INTO shipments (order_id, parcels) VALUES (%s, %s) RETURNING shipment_id",
            (message.order_id, message.parcels),
        )
        row = await cur.fetchone()
        assert row is not None
        booked = ShipmentBooked(shipment_id=int(row[0]), order_id=message.order_id, parcels=message.parcels)
        await ctx.publish(booked, destination="shipping.events", routing_key="shipment.booked",
                          partition_key=message.order_id)
        return Result(status="booked", reference=str(booked.shipment_id))


app = App("shipments", events=["shipping.events"])
app.subscribe("shipments.commands", ShipOrderHandler())
