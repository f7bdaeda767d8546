"""For any interleaving of two deliveries of one operation key, the runtime's outcomes are one of
the allowed pairs, with one effect (none for a business failure) and a terminal ledger row.

Hypothesis chooses: same or conflicting payload, a handler that fails permanently or not, how the
two deliveries meet (one after the other, at once, or B arriving while A is inside its handler,
with A held there until B is seen waiting on A's claim or has given up as ``in_progress``), and
an optional crash point that fires once on whichever delivery reaches it first.
Real PostgreSQL, memory broker; examples bounded so the test stays in seconds.
"""

from __future__ import annotations

import asyncio
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from consumer_kit import Context, Handler, PermanentFailure, Result
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.testing import Harness
from consumer_kit.testing.outcomes import TERMINAL_OUTCOMES

TABLES = "CREATE TABLE effects (operation_key text NOT NULL, amount int NOT NULL);"
AFTER_COMMIT = {CrashPoint.AFTER_COMMIT_BEFORE_ACK, CrashPoint.BEFORE_ACK}


class Charge(BaseModel):
    amount: int
    fail: bool = False


class Gate:
    """Holds the first delivery that carries header ``x-hold`` inside its handler."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.used = False


class ChargeHandler(Handler[Charge]):
    operation_type = "property.charge"

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = gate

    async def handle(self, message: Charge, ctx: Context) -> Result:
        await ctx.connection.execute(
            "INSERT INTO effects (operation_key, amount) VALUES (%s, %s)", (ctx.operation.key, message.amount)
        )
        if ctx.envelope.header("x-hold") and not self.gate.used:
            self.gate.used = True
            self.gate.entered.set()
            await self.gate.release.wait()
        if message.fail:
            raise PermanentFailure("declined", "the charge was declined")
        return Result("charged")


def allowed_pairs(same: bool, fails: bool, crash: CrashPoint | None) -> set[tuple[str, ...]]:
    first = "failed" if fails else "executed"
    again = "failed_retained" if fails else "duplicate"
    if same:
        pairs = {tuple(sorted((first, again)))}
        if crash in AFTER_COMMIT:  # the executing delivery died after COMMIT: both replay
            pairs.add((again, again))
        return pairs
    # B carries another amount and never fails: whoever claims first decides the operation
    winners = {first, "executed"}
    if crash in AFTER_COMMIT:
        winners |= {again, "duplicate"}
    return {tuple(sorted((w, "payload_conflict"))) for w in winners}


async def _b_waits_on_a(kit: Harness, b_id: str) -> bool:
    """True once B is blocked on A's claim (a lock wait on the ledger), or waits in the process
    because A was redelivered (a crash point fired on it) and runs alone, or B gave up for now."""
    if any(r.message_id == b_id for r in kit.reports):
        return True
    if kit.runtime.admission.isolating and kit._inflight >= 2:
        return True
    rows = await kit.fetch(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE %s",
        f"%{kit.schema}%operations%",
    )
    return rows[0][0] > 0


async def scenario(database_url: str, same: bool, fails: bool, meeting: str, crash: CrashPoint | None) -> None:
    gate = Gate()
    async with Harness(ChargeHandler(gate), database_url=database_url, setup_sql=TABLES) as kit:
        a = {"amount": 10, "fail": fails}
        b = a if same else {"amount": 20, "fail": False}
        if crash is not None:
            kit.crash_at(crash)
        if meeting == "sequential":
            kit.send(a, operation_id="op")
            await kit.run()
            kit.send(b, operation_id="op")
        elif meeting == "concurrent":
            kit.send(a, operation_id="op")
            kit.send(b, operation_id="op")
        else:  # B arrives while A is inside its handler
            kit.send(a, operation_id="op", headers={"x-hold": "1"})
            await asyncio.wait_for(gate.entered.wait(), 15)
            b_id = kit.send(b, operation_id="op")
            async with asyncio.timeout(15):
                while not await _b_waits_on_a(kit, b_id):
                    await asyncio.sleep(0.01)  # polling observable state (pg_stat_activity)
            gate.release.set()
        await kit.run()

        final = tuple(sorted(r.outcome.value for r in kit.settled()))
        assert all(r.outcome in TERMINAL_OUTCOMES for r in kit.settled())
        assert final in allowed_pairs(same, fails, crash), (final, same, fails, meeting, crash)
        ledger = await kit.ledger()
        assert len(ledger) == 1 and ledger[0]["state"] in ("completed", "failed"), ledger
        effects = await kit.fetch("SELECT amount FROM effects")
        winner_failed = ledger[0]["state"] == "failed"
        assert len(effects) == (0 if winner_failed else 1), (effects, ledger)
        conflicts = [reason for reason, _ in kit.dead_letters()]
        assert conflicts == ([] if same else ["payload_conflict"])
        executions = sum(r.outcome.value in ("executed", "failed") for r in kit.reports)
        assert executions <= 1


@settings(
    max_examples=int(os.environ.get("CK_PROPERTY_EXAMPLES", "16")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    same=st.booleans(),
    fails=st.booleans(),
    meeting=st.sampled_from(["sequential", "concurrent", "b_during_a_handler"]),
    crash=st.none() | st.sampled_from(
        [CrashPoint.BEFORE_CLAIM, CrashPoint.AFTER_CLAIM, CrashPoint.IN_HANDLER,
         CrashPoint.AFTER_COMMIT_BEFORE_ACK, CrashPoint.BEFORE_ACK]
    ),
)
def test_two_deliveries_of_one_key(
    database_url: str, same: bool, fails: bool, meeting: str, crash: CrashPoint | None
) -> None:
    asyncio.run(scenario(database_url, same, fails, meeting, crash))


def test_allowed_pairs_are_what_the_design_says() -> None:
    assert allowed_pairs(True, False, None) == {("duplicate", "executed")}
    assert allowed_pairs(False, False, None) == {("executed", "payload_conflict")}
    assert allowed_pairs(True, True, None) == {("failed", "failed_retained")}

