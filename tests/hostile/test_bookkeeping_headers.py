"""Every consumer-kit header with every kind of bad value, on every broker, through a real worker:
each message is dead-lettered as ``invalid_header`` naming the header or runs once with the value
ignored (the table of :mod:`consumer_kit.headers`), the healthy message after them runs, the
worker stays ready and no receive task dies. The matrix: :mod:`tests.hostile.bookkeeping`.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from adapters.memory import get_broker
from tests.hostile.bookkeeping import CASE_HEADER, Broker, run_matrix

pytestmark = pytest.mark.postgres


def _same(_kind: str, value: Any) -> Any:
    return value


async def test_every_bad_bookkeeping_header_on_memory(database_url: str) -> None:
    url = f"memory://bookkeeping-{uuid.uuid4().hex[:8]}"
    memory = get_broker(url)
    queue = "bookkeeping"

    async def send(headers: dict[str, Any], body: bytes) -> None:
        memory.send(queue, body, headers=headers)

    async def dead_letters(count: int) -> list[tuple[str, str, str]]:
        return [(str(d.message.headers[CASE_HEADER]), d.reason, d.detail) for d in memory.dead_letters(queue)]

    matrix = await run_matrix(database_url, Broker(
        queue=queue, settings={"broker_url": url}, send=send, dead_letters=dead_letters, carry=_same,
        receive_task="memory-pump:bookkeeping",
    ))
    assert len(matrix) == 16 * 10
