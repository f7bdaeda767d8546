"""What the adapter knows of an entity's LockDuration: the operator's override (one value or one per
entity, from ``CONSUMER_KIT_SERVICEBUS_LOCK_DURATIONS``) and what each lock's grant tells."""

from __future__ import annotations

import datetime as dt

import pytest

from consumer_kit.adapters.servicebus.lock_clock import LockDurations
from consumer_kit.settings import ServiceBusSettings


def test_the_setting_gives_a_lock_duration_per_entity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONSUMER_KIT_SERVICEBUS_LOCK_DURATIONS", '{"orders": 60, "t/Subscriptions/a": 30}')
    durations = LockDurations(ServiceBusSettings().lock_durations)
    assert (durations.of("ORDERS"), durations.of("t/subscriptions/a"), durations.of("other")) == (60.0, 30.0, None)


def test_a_duration_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="lock_duration must be > 0"):
        LockDurations({"orders": 0})


def test_a_grant_out_of_a_backlog_is_timed_by_what_is_left_not_by_the_message_age() -> None:
    """``locked_until - enqueued_time`` of a message that waited 8 s for a 5 s lock is 13 s; the
    grant seen now says at most 5 s."""
    durations = LockDurations()
    now = dt.datetime.now(dt.UTC)
    durations.observe("orders", now + dt.timedelta(seconds=5), now - dt.timedelta(seconds=8))
    assert 4.0 < (durations.of("orders") or 0) <= 5.0


def test_the_override_bounds_what_is_learned_and_learning_bounds_the_override() -> None:
    durations = LockDurations({"orders": 3})
    now = dt.datetime.now(dt.UTC)
    durations.observe("orders", now + dt.timedelta(seconds=60))
    assert durations.of("orders") == 3
    durations.observe("orders", now + dt.timedelta(seconds=2))  # a shorter grant wins
    assert 1.0 < (durations.of("orders") or 0) <= 2.0


def test_the_setting_refuses_a_duration_outside_service_bus_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONSUMER_KIT_SERVICEBUS_LOCK_DURATIONS", '{"orders": 1}')
    with pytest.raises(ValueError, match="greater than or equal to 5"):
        ServiceBusSettings()
