"""The Idempotency-Key field: one RFC 9651 sf-string in the published format (no database)."""

from __future__ import annotations

import pytest

from consumer_kit.errors import InvalidBody, MalformedKey, MissingKey
from consumer_kit.http.intent import RequestIntent, RequestParts
from consumer_kit.http.keys import UUID_KEYS, KeyFormat, idempotency_key, parse_sf_string
from consumer_kit.http.scope import scope_tenant

UUID = "8e03978e-40d5-43e8-bc93-6894a57f9324"


def test_the_drafts_examples_are_accepted() -> None:
    assert idempotency_key([f'"{UUID}"'], KeyFormat()) == UUID
    assert idempotency_key(['"clkyoesmbgybucifusbbtdsbohtyuuwz"'], KeyFormat()) == "clkyoesmbgybucifusbbtdsbohtyuuwz"
    assert idempotency_key([f'  "{UUID}" '], UUID_KEYS) == UUID  # RFC 9651 4.2: surrounding spaces


def test_escapes_are_decoded() -> None:
    assert parse_sf_string(r'"a\"b\\c"') == 'a"b\\c'


def test_a_missing_field_is_missing_not_malformed() -> None:
    with pytest.raises(MissingKey):
        idempotency_key([], KeyFormat())


@pytest.mark.parametrize(
    ("values", "rule"),
    [
        ([UUID], "double quotes"),  # a bare value (Stripe style) is not an sf-string
        ([f'"{UUID}'], "closing double quote"),
        ([f'"{UUID}";v=1'], "no parameters"),
        ([f'"{UUID}", "{UUID}"'], "exactly one String"),
        ([f'"{UUID}"', f'"{UUID}"'], "at most one"),
        (['"8e03978e\\n40d5"'], "escaped"),
        (['"8e03978e-40d5-43e8-\x01bc93"'], "control or non-ASCII"),
        (['"schlüssel-0123456789abc"'], "control or non-ASCII"),
        (['"short"'], "16 to 255 characters"),
        (['"has space 0123456789abcdef"'], "16 to 255 characters"),
        (['"' + "a" * 256 + '"'], "16 to 255 characters"),
        (["\"' OR 1=1 --0123456789\""], "16 to 255 characters"),
    ],
)
def test_malformed_fields_are_refused_with_the_rule(values: list[str], rule: str) -> None:
    with pytest.raises(MalformedKey) as refused:
        idempotency_key(values, KeyFormat())
    assert rule in refused.value.detail
    assert "OR 1=1" not in refused.value.detail  # the detail never quotes the key


def test_uuid_keys_accept_only_a_uuid() -> None:
    assert idempotency_key([f'"{UUID.upper()}"'], UUID_KEYS) == UUID.upper()
    with pytest.raises(MalformedKey):
        idempotency_key(['"8e03978e40d543e8bc936894a57f9324abcd"'], UUID_KEYS)


def test_client_ids_cannot_spell_another_scope() -> None:
    # "a/POST /x" must not become tenant "a" with another operation type: "/" is escaped
    assert scope_tenant("a/POST /x") == "a%2FPOST %2Fx"
    assert scope_tenant("100%") == "100%25"
    assert scope_tenant("a%2Fb") != scope_tenant("a/b")


def test_fingerprint_is_canonical_and_ignores_volatile_fields() -> None:
    intent = RequestIntent(exclude=frozenset({"requested_at", "meta.trace"}))

    def fp(body: bytes, query: list[tuple[str, str]] | None = None) -> str:
        return intent.fingerprint(RequestParts(body, "application/json", {"id": 7}, query or []))

    base = fp(b'{"amount": 10, "requested_at": "2026-01-01", "meta": {"trace": "a", "k": 1}}')
    assert fp(b'{"meta": {"k": 1.0, "trace": "b"}, "amount": 10.0, "requested_at": "2031-05-01"}') == base
    assert fp(b'{"amount": 11, "meta": {"k": 1}}') != base
    assert fp(b'{"amount": 10, "meta": {"k": 1}}', [("dry_run", "1")]) != base
    with pytest.raises(InvalidBody):
        fp(b'{"amount": NaN}')
    with pytest.raises(InvalidBody):
        fp(b'{"amount": 1, "amount": 2}')
