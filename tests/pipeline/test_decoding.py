"""Deliveries that fail before they have an identity (steps 2 and 3) must still end: a body nested
too deeply to fingerprint is invalid input, dead-lettered at once; an exception from a handler's
own hook (``operation_key``, ``tenant``, ``partition_key``, ``projection``) is a handler fault,
retried and dead-lettered after ``max_deliveries``. Before the fix both escaped
``Runtime.process`` (which promises never to raise), the adapters gave the delivery back
uncounted, and it looped forever (on RabbitMQ: ~190 copies a second, never dead-lettered, never
reaching the broker's delivery limit)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from consumer_kit import Handler, Outcome, Result
from consumer_kit.codec.envelope import Envelope
from consumer_kit.testing import Harness


class Note(BaseModel):
    n: int
    data: Any = None


class NoteHandler(Handler[Note]):
    model = Note
    operation_type = "note.take"

    def operation_key(self, message: Note, envelope: Envelope) -> str | None:
        if message.n == 13:
            return {"id": 1}["missing"]  # a bug in the handler's key function: KeyError
        return super().operation_key(message, envelope)

    async def handle(self, message: Note, ctx: Any) -> Result:
        return Result("ok")


async def test_a_body_nested_too_deeply_to_fingerprint_is_dead_lettered_as_invalid_json(database_url: str) -> None:
    deep = json.loads("[" * 700 + "]" * 700)  # strict JSON reads it; the fingerprint recursed
    async with Harness(NoteHandler(), database_url=database_url) as kit:
        reports = await kit.deliver({"n": 1, "data": deep}, operation_id="deep-1", timeout=10)
    assert [(r.outcome, r.reason) for r in reports] == [(Outcome.INVALID, "invalid_json")]
    assert [reason for reason, _ in kit.dead_letters()] == ["invalid_json"]


async def test_an_exception_from_a_handler_hook_is_retried_then_dead_lettered(database_url: str) -> None:
    async with Harness(NoteHandler(), database_url=database_url, max_deliveries=3) as kit:
        reports = await kit.deliver({"n": 13}, operation_id="unlucky", timeout=10)
        healthy = await kit.deliver({"n": 14}, operation_id="fine", timeout=10)
    assert [(r.outcome, r.reason) for r in reports] == [
        (Outcome.RETRIED, "KeyError"), (Outcome.RETRIED, "KeyError"),
        (Outcome.DEAD_LETTERED, "max_deliveries_exceeded:KeyError"),
    ]
    assert [r.outcome for r in healthy] == [Outcome.EXECUTED]


def test_an_http_body_nested_too_deeply_is_an_invalid_body_not_a_500() -> None:
    from consumer_kit.errors import InvalidBody
    from consumer_kit.http.intent import RequestIntent, RequestParts

    parts = RequestParts(b"[" * 700 + b"]" * 700, "application/json", {}, [])
    try:
        RequestIntent().fingerprint(parts)
    except InvalidBody as exc:
        assert "nested too deeply" in exc.detail
    else:
        raise AssertionError("a body nested 700 levels deep was fingerprinted")
