"""Relay settings: the ``relay`` group of consumer-kit's settings tree
(:mod:`consumer_kit.settings.relay`), re-exported where the relay's code has always found it."""

from __future__ import annotations

from consumer_kit.settings.relay import OutboxSettings, RelaySettings, RouteTarget, default_relay_id

__all__ = ["OutboxSettings", "RelaySettings", "RouteTarget", "default_relay_id"]
