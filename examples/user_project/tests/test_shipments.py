"""The user project's tests: the testing kit's fixtures, no marker, no asyncio_mode setting."""

from __future__ import annotations

from shipments import TABLES, ShipOrderHandler

ORDER = {"order_id": "o-17", "parcels": 2}


async def test_a_duplicate_storm_books_one_shipment_and_one_event(consumer_kit_harness) -> None:
    async with consumer_kit_harness(ShipOrderHandler(), setup_sql=TABLES) as kit:
        await kit.deliver(ORDER, times=4, concurrently=True)
        kit.assert_outcomes({"executed": 1, "duplicate": 3})
        await kit.assert_one_effect("SELECT count(*) FROM shipments WHERE order_id = %s", "o-17")
        [event] = await kit.outbox_events()
        assert (event.destination, event.routing_key, event.message_type) == (
            "shipping.events", "shipment.booked", "ShipmentBooked")
        assert event.payload["order_id"] == "o-17" and event.payload["parcels"] == 2


async def test_a_crash_after_commit_still_books_once(consumer_kit_harness) -> None:
    async with consumer_kit_harness(ShipOrderHandler(), setup_sql=TABLES) as kit:
        kit.crash_at("after_commit_before_ack")
        await kit.deliver(ORDER)
        await kit.assert_one_effect("SELECT count(*) FROM shipments")
        assert len(await kit.outbox_events(destination="shipping.events")) == 1


async def test_a_business_failure_writes_no_event(consumer_kit_harness) -> None:
    async with consumer_kit_harness(ShipOrderHandler(), setup_sql=TABLES) as kit:
        await kit.deliver({"order_id": "o-18", "parcels": 0}, times=2, concurrently=False)
        kit.assert_outcomes({"failed": 1, "failed_retained": 1})
        assert await kit.outbox_events() == []
