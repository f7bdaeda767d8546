"""A value ending in a newline passes a ``^...$`` pattern checked with ``re.match`` (``$`` also
matches before a final ``\\n``): every validator of names, keys and identifiers checks the whole
text (``fullmatch``). One case per validator that had the gap."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from consumer_kit.adapters.nats.envelope import headers_for
from consumer_kit.adapters.nats.topology import check_subject, key_token
from consumer_kit.adapters.sqs.envelope import is_valid_name
from consumer_kit.errors import ConfigurationError
from consumer_kit.settings import Settings


def test_a_partition_key_ending_in_a_newline_is_hashed_into_a_token() -> None:
    assert key_token("order-7") == "order-7"
    token = key_token("order-7\n")
    assert token.startswith("h") and len(token) == 33 and "\n" not in token


def test_a_nats_subject_ending_in_a_newline_is_refused() -> None:
    assert check_subject("billing.events") == "billing.events"
    with pytest.raises(ConfigurationError):
        check_subject("billing.events\n")


def test_a_nats_header_name_ending_in_a_newline_is_packed_not_sent_as_a_header() -> None:
    sent = headers_for({"tenant-id\n": "acme", "tenant-id": "acme"})
    assert "tenant-id\n" not in sent and sent["tenant-id"] == "acme"


def test_an_sqs_attribute_name_ending_in_a_newline_is_not_valid() -> None:
    assert is_valid_name("tenant-id") and not is_valid_name("tenant-id\n")


def test_a_schema_name_ending_in_a_newline_is_refused() -> None:
    with pytest.raises(ValidationError, match="plain SQL identifier"):
        Settings(database_url="postgresql://127.0.0.1/test", db_schema="app\n")

