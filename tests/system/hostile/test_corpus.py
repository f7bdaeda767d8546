"""Every hostile input: a specific dead-letter reason or a documented acceptance; the worker keeps
running; nothing lost; nothing executed twice. Runtime + memory broker + real PostgreSQL."""

from __future__ import annotations

from collections import Counter

import pytest

from consumer_kit import Outcome
from consumer_kit.broker import Settlement
from consumer_kit.testing import Harness
from tests.system.hostile.corpus import CASES, GOOD_BYTES, NFC_KEY, NFD_KEY, TABLES, Case, PlaceOrderHandler


def _dead_reasons(case: Case) -> list[str]:
    """What the DLQ must hold for ``case``: its dead-letters and its payload conflicts."""
    return [e if e.startswith("dead:") else "dead:payload_conflict"
            for e in case.expect if e.startswith("dead:") or e == "payload_conflict"]


def _expectation(report_outcome: str, reason: str | None) -> str:
    if report_outcome in ("invalid", "dead_lettered"):
        return f"dead:{reason}"
    return report_outcome


async def _send_case(kit: Harness, case: Case) -> list[str]:
    """Send the case's messages one after the other; returns their message ids."""
    ids = []
    for send in case.sends:
        ids.append(
            kit.send(send.body, operation_id=send.operation_id, headers=send.headers, message_type=send.message_type)
        )
        await kit.run()
    return ids


async def _assert_case(kit: Harness, case: Case, message_ids: list[str]) -> None:
    settled = kit.settled()
    for message_id, expected in zip(message_ids, case.expect, strict=True):
        final = [r for r in settled if r.message_id == message_id]
        # nothing lost and nothing settled twice: exactly one terminal settlement per message
        assert len(final) == 1, f"{case.name}: {message_id} settled {len(final)} times: {final}"
        assert _expectation(final[0].outcome.value, final[0].reason) == expected, (case.name, final[0])
    dead = [f"dead:{reason}" for reason, _ in kit.dead_letters()]
    assert Counter(dead) == Counter(_dead_reasons(case)), case.name
    # nothing executed twice: one effect row per executed send, never two for one key
    rows = await kit.fetch("SELECT operation_key, count(*) FROM effects GROUP BY operation_key")
    assert all(n == 1 for _, n in rows), rows
    assert sum(n for _, n in rows) == case.executions, (case.name, rows)
    await kit.assert_ledger_terminal()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_hostile_case(database_url: str, case: Case) -> None:
    async with Harness(PlaceOrderHandler(), database_url=database_url, setup_sql=TABLES) as kit:
        ids = await _send_case(kit, case)
        await _assert_case(kit, case, ids)
        # the worker keeps running: a good message afterwards is executed
        good = kit.send(GOOD_BYTES, operation_id="after-the-storm")
        await kit.run()
        assert [r.outcome for r in kit.settled() if r.message_id == good] == [Outcome.EXECUTED]
        # replaying everything adds no effect and never executes again
        replayed = kit.settled(await kit.replay_all(concurrently=False))
        assert Outcome.EXECUTED not in {r.outcome for r in replayed}, case.name
        assert await kit.fetchval("SELECT count(*) FROM effects") == case.executions + 1


async def test_whole_corpus_at_once(database_url: str) -> None:
    """All cases concurrently through one runtime (distinct keys per case), then replayed."""
    async with Harness(PlaceOrderHandler(), database_url=database_url, setup_sql=TABLES) as kit:
        expected_dead: Counter[str] = Counter()
        executions = 0
        for case in CASES:
            for send in case.sends:
                key = send.operation_id
                if key in ("op-1", NFC_KEY, NFD_KEY):
                    key = f"{key}-{case.name}"  # keys shared between cases: made one per case
                kit.send(send.body, operation_id=key, headers=send.headers, message_type=send.message_type)
            expected_dead.update(_dead_reasons(case))
            executions += case.executions
        await kit.run(timeout=120)
        # the sends of one case race each other here, so only order-independent totals are checked
        assert len(kit.settled()) == sum(len(c.sends) for c in CASES)  # nothing lost
        invalid = Counter(f"dead:{reason}" for reason, _ in kit.dead_letters())
        assert invalid == expected_dead
        rows = await kit.fetch("SELECT operation_key, count(*) FROM effects GROUP BY operation_key")
        assert all(n == 1 for _, n in rows), rows
        before = await kit.fetchval("SELECT count(*) FROM effects")
        assert before == executions
        await kit.replay_all()
        assert await kit.fetchval("SELECT count(*) FROM effects") == before
        assert all(r.settlement in (Settlement.ACK, Settlement.DEAD_LETTER, Settlement.RETRY, None) for r in kit.reports)
        await kit.assert_ledger_terminal()
