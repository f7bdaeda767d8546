"""What the testing kit puts on its broker: a body from a model, dict, text or bytes, and the
consumer-kit headers a producer would set."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from consumer_kit.codec.envelope import MESSAGE_TYPE_HEADER, OPERATION_ID_HEADER, TENANT_HEADER


@dataclass(frozen=True)
class Sent:
    """One message put on the harness broker: what ``replay_all`` sends again."""

    queue: str
    body: bytes
    headers: dict[str, Any]
    message_id: str


def message_headers(
    message_type: Any, *, operation_id: Any = None, tenant: Any = None,
    headers: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The headers of one test message: ``message-type`` (``False``: none), ``operation-id`` and
    ``tenant-id`` when given (any value: hostile input too), then ``headers``, which win."""
    all_headers: dict[str, Any] = {}
    if message_type is not False:
        all_headers[MESSAGE_TYPE_HEADER] = message_type
    if operation_id is not None:
        all_headers[OPERATION_ID_HEADER] = operation_id
    if tenant is not None:
        all_headers[TENANT_HEADER] = tenant
    all_headers.update(headers or {})
    return all_headers


def encode_body(message: Any) -> bytes:
    """``message`` as a body: bytes as they are, text as UTF-8, a pydantic model or anything else as JSON."""
    if isinstance(message, bytes):
        return message
    if isinstance(message, str):
        return message.encode("utf-8")
    if isinstance(message, BaseModel):
        return message.model_dump_json().encode("utf-8")
    return json.dumps(message, default=str).encode("utf-8")
