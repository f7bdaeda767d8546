"""Broker URL options read the same way by every adapter (:mod:`consumer_kit.broker.kit.url_options`): the
flags, numbers and unknown options of ``sqs://`` and ``nats://`` URLs. No broker needed."""

from __future__ import annotations

import pytest

from consumer_kit.adapters.nats import NATSConfig
from consumer_kit.adapters.sqs import SQSConfig
from consumer_kit.broker.kit.url_options import flag, number, url_options
from consumer_kit.errors import ConfigurationError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("on", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        ("off", False),
        ("False", False),
        ("0", False),
        ("no", False),
    ],
)
def test_a_flag_takes_the_usual_spellings_in_any_case(value: str, expected: bool) -> None:
    assert flag({"heartbeat": value}, "heartbeat", not expected, scheme="x") is expected
    assert SQSConfig.from_url(f"sqs://127.0.0.1:1?heartbeat={value}").heartbeat is expected
    assert NATSConfig.from_url(f"nats://127.0.0.1?ordered={value}").ordered is expected


def test_an_absent_flag_is_its_default_and_the_last_repeated_value_wins() -> None:
    assert flag({}, "heartbeat", True, scheme="x") is True
    assert url_options("wait=1&wait=2", {"wait"}, scheme="sqs") == {"wait": "2"}
    assert SQSConfig.from_url("sqs://127.0.0.1:1?tls=on&tls=off").endpoint_url == "http://127.0.0.1:1"


def test_a_flag_that_is_neither_says_which_option_of_which_scheme() -> None:
    with pytest.raises(
        ConfigurationError, match=r"^sqs:// option create_queues must be true or false, not 'maybe'$"
    ):
        SQSConfig.from_url("sqs://127.0.0.1:1?create_queues=maybe")
    with pytest.raises(
        ConfigurationError, match=r"^nats:// option heartbeat must be true or false, not 'sometimes'$"
    ):
        NATSConfig.from_url("nats://127.0.0.1?heartbeat=sometimes")


def test_an_unknown_option_is_refused_with_the_known_ones_and_never_the_url() -> None:
    with pytest.raises(ConfigurationError) as refused:
        NATSConfig.from_url("nats://user:secret@127.0.0.1?ack_wait=5&colour=blue&size=3")
    text = str(refused.value)
    assert text.startswith("unknown nats:// option(s) colour, size; known: ['ack_wait', ")
    assert "secret" not in text
    with pytest.raises(ConfigurationError, match=r"^unknown sqs:// option\(s\) colour; known: \["):
        SQSConfig.from_url("sqs://127.0.0.1:1?colour=blue")


def test_a_number_is_its_default_when_absent_and_within_its_bounds_when_given() -> None:
    assert number({}, "ack_wait", 30.0, 1.0, 60.0, scheme="x") == 30.0
    assert number({"ack_wait": "2.5"}, "ack_wait", 30.0, 1.0, 60.0, scheme="x") == 2.5
    assert number({"wait": "7"}, "wait", 10, 0, 20, scheme="x", whole=True) == 7
    assert NATSConfig.from_url("nats://127.0.0.1?fetch_wait=0.5").fetch_wait == 0.5
    assert SQSConfig.from_url("sqs://127.0.0.1:1?wait=0&visibility=90").visibility_timeout == 90


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqs://127.0.0.1:1?wait=2.5", r"^sqs:// option wait must be whole seconds, not '2\.5'$"),
        ("sqs://127.0.0.1:1?wait=21", r"^sqs:// option wait must be 0 to 20 seconds, not 21$"),
        ("sqs://127.0.0.1:1?visibility=0", r"^sqs:// option visibility must be 1 to 43200 seconds, not 0$"),
        ("nats://127.0.0.1?ack_wait=soon", r"^nats:// option ack_wait must be a number, not 'soon'$"),
        ("nats://127.0.0.1?fetch_wait=0.05", r"^nats:// option fetch_wait must be 0\.1 to 60 seconds, not 0\.05$"),
        ("nats://127.0.0.1?max_deliver=2.5", r"^nats:// option max_deliver must be a whole number, not '2\.5'$"),
        ("nats://127.0.0.1?max_deliver=1", r"^nats:// option max_deliver must be 2 to 1000000, not 1$"),
    ],
)
def test_a_number_out_of_bounds_or_not_a_number_says_which_option_and_its_bounds(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        SQSConfig.from_url(url) if url.startswith("sqs") else NATSConfig.from_url(url)
