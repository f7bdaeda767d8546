"""docker-compose.yml: no Docker engine here, so check its references (the schema is checked by
check-jsonschema in .ci/run)."""

from __future__ import annotations

from pathlib import Path

import yaml

COMPOSE = yaml.safe_load((Path(__file__).parents[2] / "docker-compose.yml").read_text())


def test_depends_on_names_existing_services() -> None:
    services = COMPOSE["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on missing service {dependency}"


def test_named_volumes_are_declared() -> None:
    declared = set(COMPOSE.get("volumes", {}))
    for name, service in COMPOSE["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} uses undeclared volume {source}"


def test_brokers_and_database_ports_match_the_defaults() -> None:
    assert "127.0.0.1:5432:5432" in COMPOSE["services"]["postgres"]["ports"]
    assert "127.0.0.1:5672:5672" in COMPOSE["services"]["rabbitmq"]["ports"]
