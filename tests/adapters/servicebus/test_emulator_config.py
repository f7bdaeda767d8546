"""docker-compose's Service Bus emulator: no Docker engine here, so check what can be checked without
one: the config file it mounts declares what the invoices example uses, within the emulator's
documented limits, and the emulator's port does not collide with RabbitMQ's."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from consumer_kit.demo.app import app

ROOT = Path(__file__).parents[3]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
ISO_DURATION = re.compile(r"^PT(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?$")


def seconds(duration: str) -> int:
    match = ISO_DURATION.match(duration)
    assert match, f"not an ISO 8601 time duration: {duration}"
    hours, minutes, secs = (int(part or 0) for part in match.groups())
    return hours * 3600 + minutes * 60 + secs


def emulator_config() -> dict[str, Any]:
    [mount] = COMPOSE["services"]["servicebus"]["volumes"]
    source, target = mount.split(":")[:2]
    assert target == "/ServiceBus_Emulator/ConfigFiles/Config.json"
    config: dict[str, Any] = json.loads((ROOT / source).read_text())
    return config


def test_the_emulator_declares_the_example_queue_and_event_topic_within_its_limits() -> None:
    [namespace] = emulator_config()["UserConfig"]["Namespaces"]
    assert namespace["Name"] == "sbemulatorns"  # the only name the emulator accepts
    queues = {q["Name"]: q["Properties"] for q in namespace["Queues"]}
    topics = {t["Name"]: t for t in namespace["Topics"]}
    assert set(app.queues) <= set(queues)
    assert "billing.events" in topics and topics["billing.events"]["Subscriptions"]
    entities = [*queues.values(), *(s["Properties"] for t in topics.values() for s in t["Subscriptions"])]
    for properties in entities:
        assert 5 <= seconds(properties["LockDuration"]) <= 300
        # The emulator's config schema caps MaxDeliveryCount at 10 (docs/brokers/servicebus.md,
        # unverified here: no Docker engine); above consumer-kit's default bounds
        # (MAX_DELIVERIES 5 + CRASH_LIMIT 3), the most the emulator allows
        assert 5 + 3 < properties["MaxDeliveryCount"] <= 10
        assert 300 <= seconds(properties["DefaultMessageTimeToLive"]) <= 3600


def test_the_emulator_and_its_sql_server_run_only_when_asked_for_on_their_own_port() -> None:
    services = COMPOSE["services"]
    emulator, sql_server = services["servicebus"], services["servicebus-sql"]
    assert emulator["profiles"] == sql_server["profiles"] == ["servicebus"]
    assert emulator["depends_on"] == ["servicebus-sql"]
    assert emulator["environment"]["SQL_SERVER"] == "servicebus-sql"
    assert emulator["environment"]["MSSQL_SA_PASSWORD"] == sql_server["environment"]["MSSQL_SA_PASSWORD"]
    assert emulator["ports"] == ["127.0.0.1:5673:5672"]
    assert "127.0.0.1:5672:5672" in services["rabbitmq"]["ports"]
