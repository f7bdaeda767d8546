"""External effects: the leased path with fencing, downstream keys, evidence and reconciliation.

The notifications example (``examples/notifications``) sends welcome e-mails through a local fake
provider that does not deduplicate and records every send, so "exactly one e-mail" is checked
where it happens. Real PostgreSQL and RabbitMQ; worker subprocesses where a process must die.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import psycopg
import pytest

from consumer_kit import App, Context, Outcome, Result
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.testing import Harness
from examples.notifications.app import SCHEMA_SQL, ProviderClient, SendWelcome, WelcomeEmailHandler
from examples.notifications.provider import FakeProvider
from tests.fixtures.broker_env import command
from tests.fixtures.resilience import ResilienceEnv, count

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

# A lease no attempt of these tests comes near: renewed every third of it, an attempt is stopped
# once a renewal has not come back within 0.9 of it, which a loaded machine could outrun with a
# 1.5 s lease. The tests about a lease running out wait for a dead worker's own (DEAD_LEASE) or
# make it explicit; the renewal test has its own (RENEWED_LEASE).
LEASED = {"lease_seconds": 30, "in_progress_delay": 0.2, "retry_delays": [0.2], "max_deliveries": 5}
DEAD_LEASE = 3.0  # seconds: the lease of a worker killed during the call, waited out by the next one
RENEWED_LEASE = 3.0  # seconds: renewed every 1 s, each renewal has 1.7 s to come back


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    fake = FakeProvider().start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
async def nenv(renv: ResilienceEnv) -> AsyncIterator[ResilienceEnv]:
    """``renv`` with the notifications example's table in its schema."""
    async with await psycopg.AsyncConnection.connect(
        renv.database_url, autocommit=True, options=f"-c search_path={renv.schema}"
    ) as conn:
        await conn.execute(SCHEMA_SQL)
    yield renv


def welcome(user_id: int = 7) -> bytes:
    return SendWelcome(user_id=user_id, email=f"user{user_id}@example.test").model_dump_json().encode()


def app_with(handler: Any, queue: str) -> App:
    app = App("notifications-test")
    app.subscribe(queue, handler)
    return app


async def control(provider: FakeProvider, **settings: Any) -> None:
    async with httpx.AsyncClient(base_url=provider.url) as client:
        (await client.post("/_control", json=settings)).raise_for_status()


async def ledger_row(env: ResilienceEnv, key: str) -> tuple[Any, ...]:
    (row,) = await env.rows("SELECT state, attempts, lease_owner FROM operations WHERE key = %s", key)
    return row


# -- SIGKILL during the remote call -------------------------------------------------------------------


@pytest.mark.slow
async def test_worker_killed_during_the_remote_call_is_reconciled_without_a_second_send(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """The worker sends, the provider accepts, and the process dies before it records the reply
    (crash point ``during_external_call``, SIGKILL). Once its lease expires a second worker takes
    it over, reconciles from the evidence by asking the provider, and completes without sending
    again: one e-mail, ledger ``completed`` at attempt 2, outcome ``lease_recovered``."""
    async with nenv.run(app_with(WelcomeEmailHandler(ProviderClient(provider.url)), nenv.queue), **LEASED):
        pass  # declare the topology
    doomed = subprocess.Popen(
        [sys.executable, "-m", "consumer_kit", "worker", "tests.fixtures.apps.notifications_on_test_queue:app"],
        env=nenv.worker_environment(
            PROVIDER_URL=provider.url, CONSUMER_KIT_LEASE_SECONDS=str(DEAD_LEASE),
            CONSUMER_KIT_CRASH_AT="during_external_call:kill",
        ),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        await nenv.send(welcome(7), message_type="SendWelcome")
        code = await asyncio.wait_for(asyncio.to_thread(doomed.wait), 60)
    finally:
        if doomed.poll() is None:
            doomed.kill()
    assert code == -signal.SIGKILL
    assert len(provider.sent) == 1  # the e-mail went out; its reply was never recorded
    state, attempt, owner = await ledger_row(nenv, "welcome-7")
    assert (state, attempt) == ("processing", 1) and owner  # the dead worker's lease
    async with nenv.run(app_with(WelcomeEmailHandler(ProviderClient(provider.url)), nenv.queue), **LEASED):
        reports = await nenv.outcomes_until(lambda seen: count(seen, Outcome.LEASE_RECOVERED) == 1, timeout=30)
    assert {r.outcome for r in reports} <= {Outcome.IN_PROGRESS, Outcome.LEASE_RECOVERED}
    assert len(provider.sent) == 1
    assert await ledger_row(nenv, "welcome-7") == ("completed", 2, None)
    assert await nenv.rows("SELECT user_id, provider_message_id FROM welcome_emails") == [(7, "msg-1")]
    assert await nenv.rows("SELECT count(*) FROM outbox") == [(1,)]
    names = await nenv.rows("SELECT name, attempt, facts ? 'intent' FROM evidence ORDER BY id")
    assert names == [("send", 1, True)]  # the intent, recorded before the call by attempt 1


# -- a provider that accepts and then times out -------------------------------------------------------


async def test_a_timeout_after_the_provider_accepted_is_reconciled_not_resent(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """A timeout is not a failure: the provider accepts the send and answers too late. The handler
    fault gives the lease up; the retry takes it over, finds the send by its downstream key and
    completes without a second send. The retry's lookup must answer within the client's timeout:
    3 s, which a loaded machine does not outrun (0.5 s it could: parked as unknown); the send
    answers after 6 s, so it always times out."""
    await control(provider, slow_sends=1, delay=6.0)
    handler = WelcomeEmailHandler(ProviderClient(provider.url, timeout=3.0))
    async with nenv.run(app_with(handler, nenv.queue), **LEASED):
        await nenv.send(welcome(8), message_type="SendWelcome")
        reports = await nenv.outcomes_until(lambda seen: count(seen, Outcome.LEASE_RECOVERED) == 1, timeout=30)
    assert [r.outcome for r in reports] == [Outcome.RETRIED, Outcome.LEASE_RECOVERED]
    assert reports[0].reason == "ReadTimeout"
    assert [m["reference"] for m in provider.sent] == [handler_key(nenv, "welcome-8")]
    assert await ledger_row(nenv, "welcome-8") == ("completed", 2, None)
    assert await nenv.rows("SELECT provider_message_id FROM welcome_emails") == [("msg-1",)]


def handler_key(env: ResilienceEnv, key: str) -> str:
    from consumer_kit.identity import downstream_key

    return downstream_key("default/email.welcome/v1", key, "send")


async def test_a_provider_that_cannot_be_asked_parks_the_operation_and_never_sends_again(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """After the timeout, the provider's lookups are down: the outcome is unknown. The operation
    is parked as ``needs_reconciliation`` and its message dead-lettered with that reason; nothing
    is sent blindly, and a redelivered copy is refused the same way."""
    await control(provider, slow_sends=1, delay=3.0, lookups_down=True)
    handler = WelcomeEmailHandler(ProviderClient(provider.url, timeout=0.5))
    async with nenv.run(app_with(handler, nenv.queue), **LEASED):
        await nenv.send(welcome(9), message_type="SendWelcome")
        reports = await nenv.outcomes_until(lambda seen: count(seen, Outcome.UNCERTAIN) == 1, timeout=30)
        await nenv.send(welcome(9), message_type="SendWelcome")  # a duplicate after parking
        (again,) = await nenv.next_reports(1)
    assert [r.outcome for r in reports] == [Outcome.RETRIED, Outcome.UNCERTAIN]
    assert reports[-1].reason == again.reason == "needs_reconciliation"
    assert len(provider.sent) == 1
    assert (await ledger_row(nenv, "welcome-9"))[0] == "needs_reconciliation"
    assert await nenv.rows("SELECT count(*) FROM welcome_emails") == [(0,)]
    dead = await nenv.dead_letters(2)
    assert [m.headers["x-dead-letter-reason"] for m in dead] == ["needs_reconciliation"] * 2
    assert "could not be asked" in str(dead[0].headers["x-dead-letter-detail"])


# -- lease renewal and fencing -----------------------------------------------------------------------


class SlowProviderHandler(WelcomeEmailHandler):
    """The provider call takes ``hold`` seconds (the test may also act meanwhile)."""

    def __init__(self, provider: ProviderClient, hold: float) -> None:
        super().__init__(provider)
        self.hold = hold
        self.calling = asyncio.Event()
        self.proceed = asyncio.Event()
        self.running = 0
        self.max_running = 0

    async def handle(self, message: SendWelcome, ctx: Context) -> Result:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await ctx.record_evidence("send", intent="welcome")
            self.calling.set()
            with contextlib.suppress(TimeoutError):  # a call that lasts ``hold`` s unless told to go on
                await asyncio.wait_for(self.proceed.wait(), self.hold)
            provider_id = await self.provider.send(to=message.email, template="welcome",
                                                   reference=ctx.downstream_key("send"))
            return await self._record_sent(message, ctx, provider_id)
        finally:
            self.running -= 1


async def test_renewal_keeps_a_handler_three_leases_long_and_duplicates_wait(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """A call that lasts three lease lengths keeps the operation: the lease and the peek-lock are
    renewed, no other delivery takes it over, and a duplicate arriving during the call is
    ``in_progress`` until it completes (never run in parallel), then a duplicate."""
    handler = SlowProviderHandler(ProviderClient(provider.url), hold=RENEWED_LEASE * 3)
    async with nenv.run(app_with(handler, nenv.queue), **{**LEASED, "lease_seconds": RENEWED_LEASE}):
        await nenv.send(welcome(10), message_type="SendWelcome")
        await asyncio.wait_for(handler.calling.wait(), 10)
        await nenv.send(welcome(10), message_type="SendWelcome")
        reports = await nenv.outcomes_until(
            lambda seen: count(seen, Outcome.EXECUTED) == 1 and count(seen, Outcome.DUPLICATE) == 1, timeout=30,
        )
    assert count(reports, Outcome.IN_PROGRESS) >= 1  # the duplicate waited, more than once
    assert {r.outcome for r in reports} == {Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.IN_PROGRESS}
    assert handler.max_running == 1 and len(provider.sent) == 1
    assert await ledger_row(nenv, "welcome-10") == ("completed", 1, None)  # never taken over


class CancelRecordingHandler(SlowProviderHandler):
    """Records when the attempt was cancelled (wall clock, seconds since the epoch)."""

    def __init__(self, provider: ProviderClient, hold: float) -> None:
        super().__init__(provider, hold)
        self.cancelled = asyncio.Event()
        self.cancelled_at: float | None = None

    async def handle(self, message: SendWelcome, ctx: Context) -> Result:
        try:
            return await super().handle(message, ctx)
        except asyncio.CancelledError:
            self.cancelled_at = time.time()
            self.cancelled.set()
            raise


async def test_a_renewal_that_hangs_stops_the_attempt_before_its_lease_runs_out(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """The ledger row is locked by someone else, so the lease renewal hangs (lock and statement
    timeouts far longer than the lease). The attempt must stop while the ledger's lease still
    holds, not when the hung renewal gives up: a second worker may take the lease over at expiry,
    and two attempts must never call the provider at once. Nothing is sent, the delivery is
    released as lease_lost. The attempt stops a tenth of the lease before it runs out: 10 s
    leaves it 1 s, which a loaded machine does not outrun (5 s left it 0.5 s)."""
    handler = CancelRecordingHandler(ProviderClient(provider.url), hold=60)
    settings = {**LEASED, "lease_seconds": 10, "lock_timeout": 60, "statement_timeout": 60}
    async with nenv.run(app_with(handler, nenv.queue), **settings):
        await nenv.send(welcome(12), message_type="SendWelcome")
        await asyncio.wait_for(handler.calling.wait(), 10)
        async with await psycopg.AsyncConnection.connect(
            nenv.database_url, options=f"-c search_path={nenv.schema}"
        ) as blocker:  # not autocommit: the row lock is held until the rollback
            await blocker.execute("SELECT 1 FROM operations WHERE key = 'welcome-12' FOR UPDATE")
            await asyncio.wait_for(handler.cancelled.wait(), 30)
            cur = await blocker.execute(
                "SELECT extract(epoch FROM lease_expires_at) FROM operations WHERE key = 'welcome-12'"
            )
            (expires_at,) = await cur.fetchone()
            await blocker.rollback()
        (lost, *_rest) = await nenv.next_reports(1)
    assert handler.cancelled_at is not None and handler.cancelled_at < float(expires_at)
    assert lost.outcome == Outcome.LEASE_LOST
    assert provider.sent == []


class BlockingFirstHandler(WelcomeEmailHandler):
    """Its first attempt keeps the event loop busy for ``block`` seconds before its first await
    (synchronous work: a blocking client, a CPU-bound step), so the lease renewer, a task of the
    same loop created just before the handler runs, starts that much after the claim; then a
    remote call of ``hold`` seconds. Later attempts run as usual."""

    def __init__(self, provider: ProviderClient, block: float, hold: float = 0.0) -> None:
        super().__init__(provider)
        self.block, self.hold = block, hold
        self.calls = 0
        self.first_cancelled = False

    async def handle(self, message: SendWelcome, ctx: Context) -> Result:
        self.calls += 1
        if self.calls > 1:
            return await super().handle(message, ctx)
        time.sleep(self.block)  # blocking the loop is the point: the renewer starts late
        try:
            await asyncio.sleep(self.hold)  # the call's duration, not a wait for anything
            return await super().handle(message, ctx)
        except asyncio.CancelledError:
            self.first_cancelled = True
            raise


async def test_an_attempt_whose_renewer_starts_late_is_stopped_by_the_claims_deadline(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """The ledger's lease runs from the claim (the database's now()), so the attempt's deadline,
    a tenth of the lease before it runs out, counts from when the claim was sent, not from when
    the renewer got to run. The handler keeps the loop busy past that deadline (0.95 of the lease)
    before its first await: the renewer, starting late, stops the attempt at its first await
    (lease_lost), instead of counting a whole lease from its own start and renewing a lease that
    had run out meanwhile. Deterministic: when the renewer starts, 0.95 of the lease has passed
    since the claim was sent, whatever the machine's load."""
    lease = 1.0
    handler = BlockingFirstHandler(ProviderClient(provider.url), block=lease * 0.95)
    async with nenv.run(app_with(handler, nenv.queue), **{**LEASED, "lease_seconds": lease}):
        await nenv.send(welcome(13), message_type="SendWelcome")
        (first, *_rest) = await nenv.next_reports(1)
    assert (first.outcome, first.settlement) == (Outcome.LEASE_LOST, "released")
    assert handler.first_cancelled


async def test_a_renewer_that_starts_late_but_before_the_deadline_renews_at_once(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """The first renewal is due a third of the lease after the claim was sent, not after the
    renewer started: a renewer that starts 0.6 of the lease late renews at once, and the attempt,
    which runs half a lease more, completes (renewing a third of the lease after its own start
    would come after the deadline, 0.9 of the lease, and stop a healthy attempt). With a 6 s
    lease the first renewal has 1.8 s to come back, enough on a loaded machine."""
    lease = 6.0
    handler = BlockingFirstHandler(ProviderClient(provider.url), block=lease * 0.6, hold=lease * 0.5)
    async with nenv.run(app_with(handler, nenv.queue), **{**LEASED, "lease_seconds": lease}):
        await nenv.send(welcome(14), message_type="SendWelcome")
        (first, *_rest) = await nenv.next_reports(1)
    assert (first.outcome, handler.calls, handler.first_cancelled) == (Outcome.EXECUTED, 1, False)
    assert len(provider.sent) == 1
    assert await ledger_row(nenv, "welcome-14") == ("completed", 1, None)


async def test_a_worker_whose_lease_was_taken_over_cannot_complete(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """While the handler calls the provider, another owner takes the lease over (its attempt
    number moves on). The first worker's completion is fenced out: nothing local is written, the
    delivery is not acked (released), and the log says so; the new owner's row is untouched."""
    handler = SlowProviderHandler(ProviderClient(provider.url), hold=30)
    async with nenv.run(app_with(handler, nenv.queue), **LEASED):
        await nenv.send(welcome(11), message_type="SendWelcome")
        await asyncio.wait_for(handler.calling.wait(), 10)
        await nenv.rows(
            "UPDATE operations SET lease_owner = 'thief:1:x', attempts = attempts + 1 WHERE key = 'welcome-11' "
            "RETURNING 1"
        )
        handler.proceed.set()
        (lost, *_rest) = await nenv.next_reports(1)
    assert (lost.outcome, lost.settlement) == (Outcome.LEASE_LOST, "released")
    assert await ledger_row(nenv, "welcome-11") == ("processing", 2, "thief:1:x")
    assert await nenv.rows("SELECT count(*) FROM welcome_emails") == [(0,)]
    assert await nenv.rows("SELECT count(*) FROM outbox") == [(0,)]


async def test_two_deliveries_racing_for_an_expired_lease_reconcile_it_once(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """A crashed attempt left the row processing with an expired lease. Two copies arrive on two
    workers: one takes the lease over (compare-and-set on owner and attempt) and reconciles, the
    other waits (``in_progress``) and then answers as a duplicate."""
    await nenv.rows(
        "INSERT INTO operations (scope, key, tenant, operation_type, fingerprint, projection_version, "
        "state, attempts, lease_owner, lease_expires_at) VALUES ('default/email.welcome/v1', 'welcome-12', "
        "'default', 'email.welcome', %s, 1, 'processing', 1, 'dead:1:x', now() - interval '1 minute') RETURNING 1",
        _fingerprint(12),
    )
    handler = WelcomeEmailHandler(ProviderClient(provider.url))
    app = app_with(handler, nenv.queue)
    async with nenv.run(app, **LEASED), nenv.run(app, **LEASED):
        await nenv.send(welcome(12), message_type="SendWelcome")
        await nenv.send(welcome(12), message_type="SendWelcome")
        reports = await nenv.outcomes_until(
            lambda seen: count(seen, Outcome.LEASE_RECOVERED) == 1 and count(seen, Outcome.DUPLICATE) == 1,
        )
    assert count(reports, Outcome.EXECUTED) == 0
    assert len(provider.sent) == 1  # no evidence: not_done, so one send by the new owner
    assert await ledger_row(nenv, "welcome-12") == ("completed", 2, None)


def _fingerprint(user_id: int) -> str:
    message = SendWelcome.model_validate_json(welcome(user_id))
    fingerprint = WelcomeEmailHandler().fingerprint_under(message, 1)
    assert fingerprint is not None
    return fingerprint


async def test_a_transactional_handler_never_re_runs_a_row_with_an_expired_lease(renv: ResilienceEnv) -> None:
    """A processing row whose lease is live is ``in_progress``; once the lease has expired a handler
    without external effects cannot reconcile it: dead-lettered as ``needs_reconciliation``,
    never run blindly (Before the fix it was re-run: two invoices)."""
    message = CreateInvoice.model_validate_json(command(8))
    handler = CreateInvoiceHandler()
    await renv.rows(
        "INSERT INTO operations (scope, key, tenant, operation_type, fingerprint, projection_version, "
        "state, attempts, lease_owner, lease_expires_at) VALUES ('default/invoice.create/v1', 'order-8-rev-2', "
        "'default', 'invoice.create', %s, 1, 'processing', 1, 'other:1:x', now() + interval '1 hour') RETURNING 1",
        handler.fingerprint_under(message, 1),
    )
    async with renv.run(renv.app()):
        await renv.send_command(8)
        waiting = await renv.outcomes_until(lambda seen: count(seen, Outcome.IN_PROGRESS) >= 2)
        await renv.rows("UPDATE operations SET lease_expires_at = now() - interval '1 second' RETURNING 1")
        rest = await renv.outcomes_until(lambda seen: count(seen, Outcome.UNCERTAIN) == 1)
    assert {(r.outcome, r.reason) for r in waiting} == {(Outcome.IN_PROGRESS, "lease_held")}
    assert rest[-1].reason == "needs_reconciliation"
    assert await renv.rows("SELECT count(*) FROM invoices") == [(0,)]
    assert (await renv.dead_letters(1))[0].headers["x-dead-letter-reason"] == "needs_reconciliation"


# -- a handler that sends COMMIT; BEGIN itself -------------------------------------------------------


class CommitBeginHandler(CreateInvoiceHandler):
    """Does the example's writes, then ends the delivery's transaction and begins a new one."""

    async def handle(self, message: CreateInvoice, ctx: Context) -> Result:
        result = await super().handle(message, ctx)
        await ctx.connection.execute("COMMIT")
        await ctx.connection.execute("BEGIN")
        return result


async def test_a_handler_that_commits_and_begins_anew_is_parked_not_executed_twice(renv: ResilienceEnv) -> None:
    """Before the fix the check only looked for an idle connection, so ``COMMIT; BEGIN`` passed, the
    lease later expired and a redelivery ran the handler again (two invoices). The completion is
    fenced by the claiming transaction's id: parked as ``needs_reconciliation``, and every copy after
    is refused the same way: one invoice."""
    async with renv.run(renv.app(CommitBeginHandler()), lease_seconds=1.0):
        await renv.send_command(5)
        (parked,) = await renv.next_reports(1)
        await renv.send_command(5)
        (again,) = await renv.next_reports(1)
    assert (parked.outcome, parked.reason) == (Outcome.UNCERTAIN, "needs_reconciliation")
    assert (again.outcome, again.reason) == (Outcome.UNCERTAIN, "needs_reconciliation")
    assert await renv.rows("SELECT count(*) FROM invoices") == [(1,)]
    assert await renv.rows("SELECT state FROM operations") == [("needs_reconciliation",)]


# -- the crash-point kit reaches during_external_call ------------------------------------------------


async def test_the_crash_point_kit_reaches_during_external_call(database_url: str, provider: FakeProvider) -> None:
    handler = WelcomeEmailHandler(ProviderClient(provider.url))
    # A lease the attempts never race (with 1 s, a renewal had 0.57 s to come back); the dead
    # attempt's lease runs out when the test says so, not when it is waited out.
    async with Harness(handler, database_url=database_url, setup_sql=SCHEMA_SQL, lease_seconds=30) as kit:
        kit.crash_at(CrashPoint.DURING_EXTERNAL_CALL)
        kit.send(SendWelcome(user_id=13, email="u13@example.test"))
        async with asyncio.timeout(30):
            while not any(r.outcome is Outcome.CRASHED for r in kit.reports):
                await asyncio.sleep(0.02)  # polling the kit's reports for the crash
        assert await kit.fetch(
            "UPDATE operations SET lease_expires_at = now() - interval '1 second' RETURNING 1"
        ) == [(1,)]  # the dead attempt's lease has run out
        await kit.run(timeout=30)
        reports = kit.reports
    outcomes = [r.outcome for r in reports]
    assert outcomes[0] is Outcome.CRASHED and outcomes[-1] is Outcome.LEASE_RECOVERED, outcomes
    assert len(provider.sent) == 1
    assert provider.sent[0]["reference"] == handler_key_for_harness(13)


def handler_key_for_harness(user_id: int) -> str:
    from consumer_kit.identity import downstream_key

    return downstream_key("default/email.welcome/v1", f"welcome-{user_id}", "send")


# -- the operator's tools --------------------------------------------------------------------------


def ledger_cli(env: ResilienceEnv, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumer_kit", "ledger", *args],
        env={**env.worker_environment(), "COLUMNS": "200"}, capture_output=True, text=True, timeout=60,
    )


async def test_an_operator_lists_shows_and_resolves_a_parked_operation_and_its_redrive_is_a_duplicate(
    nenv: ResilienceEnv, provider: FakeProvider
) -> None:
    """The operation is parked (the provider cannot be asked). ``ledger list`` finds it, ``ledger
    show`` prints its evidence but no body, ``ledger resolve --completed`` settles it with who and
    why, and the parked message, redriven, answers as a duplicate: still one e-mail."""
    await control(provider, slow_sends=1, delay=3.0, lookups_down=True)
    handler = WelcomeEmailHandler(ProviderClient(provider.url, timeout=0.5))
    async with nenv.run(app_with(handler, nenv.queue), **LEASED):
        await nenv.send(welcome(14), message_type="SendWelcome")
        await nenv.outcomes_until(lambda seen: count(seen, Outcome.UNCERTAIN) == 1, timeout=30)
        listed = await asyncio.to_thread(ledger_cli, nenv, "list", "--state", "needs_reconciliation", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [(r["scope"], r["key"]) for r in json.loads(listed.stdout)] == [("default/email.welcome/v1", "welcome-14")]
        shown = await asyncio.to_thread(ledger_cli, nenv, "show", "default/email.welcome/v1", "welcome-14", "--json")
        detail = json.loads(shown.stdout)
        assert detail["summary"]["state"] == "needs_reconciliation"
        assert [e["name"] for e in detail["evidence"]] == ["send"]
        assert detail["result_body"] is None and detail["attempts"]["failures"] == 1
        bare = await asyncio.to_thread(ledger_cli, nenv, "show", "email.welcome", "welcome-14")
        assert bare.returncode == 2 and "a scope is tenant/operation type/version" in bare.stderr
        refused = await asyncio.to_thread(ledger_cli, nenv, "resolve", "default/email.welcome/v1", "welcome-14", "--completed")
        assert refused.returncode == 2 and "--note is required" in refused.stderr
        resolved = await asyncio.to_thread(
            ledger_cli, nenv, "resolve", "default/email.welcome/v1", "welcome-14", "--completed",
            "--note", "msg-1 seen in the provider's dashboard", "--by", "ops@example",
        )
        assert resolved.returncode == 0, resolved.stderr
        (parked,) = await nenv.dead_letters(1)
        await nenv.send(parked.body, message_type="SendWelcome")  # the redrive
        (redriven,) = await nenv.next_reports(1)
    assert redriven.outcome is Outcome.DUPLICATE
    assert len(provider.sent) == 1
    assert await nenv.rows("SELECT state, resolved_by, resolution_note FROM operations") == [
        ("completed", "ops@example", "msg-1 seen in the provider's dashboard")
    ]

