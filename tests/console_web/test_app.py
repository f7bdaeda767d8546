"""The operator's console (``consumer-kit console``) in a real browser: Debian's Chromium, headless,
driven by Playwright (``/usr/bin/chromium``; never a browser download), against real PostgreSQL and
RabbitMQ, with workers running in this process.

- a parked operation resolved from the page, its redriven message answered as a duplicate;
- a parked operation marked "not done" from the page runs again with the same downstream key;
- a group of dead letters redriven from the page (dry run first): each executed once;
- no token: 401; a forged POST without the CSRF token (or from another origin): 403;
- keys, ids and evidence holding markup and script render as text; read-only mode changes nothing.

With ``CONSUMER_KIT_CONSOLE_SCREENSHOTS=DIR`` the tests save each page at 1280x800 there (how
docs/images/console/ was made).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import uvicorn
from typer.testing import CliRunner

from consumer_kit import App, Context, Outcome, RetryableError
from consumer_kit.cli.main import cli
from consumer_kit.console_web import ConsoleConfig, create_app
from consumer_kit.demo.app import CreateInvoice, CreateInvoiceHandler
from consumer_kit.identity import downstream_key
from consumer_kit.settings import Settings
from examples.notifications.app import SCHEMA_SQL, ProviderClient, SendWelcome, WelcomeEmailHandler
from examples.notifications.provider import FakeProvider
from tests.adapters.contract.conftest import Contract
from tests.adapters.contract.servicebus_driver import ServiceBusDriver
from tests.adapters.contract.sqs_driver import SQSDriver
from tests.adapters.servicebus.server import ServiceBusTestServer
from tests.fixtures.broker_env import command
from tests.fixtures.harness import throwaway_schema
from tests.fixtures.moto_server import sqs_endpoint  # noqa: F401 - fixture
from tests.fixtures.resilience import ResilienceEnv, count

playwright_api = pytest.importorskip("playwright.async_api")

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TOKEN = "test-token-" + "x" * 20
LEASED = {"lease_seconds": 30, "in_progress_delay": 0.2, "retry_delays": [0.2], "max_deliveries": 5}
HOSTILE_KEY = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"><b>bold</b>'
SCREENSHOTS = os.environ.get("CONSUMER_KIT_CONSOLE_SCREENSHOTS")


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    if not Path(CHROMIUM).exists():
        message = f"{CHROMIUM} missing: apt-get install -y chromium chromium-driver (.ci/run does)"
        if os.environ.get("CONSUMER_KIT_REQUIRE_SERVICES") == "1":
            pytest.fail(message)
        pytest.skip(message)
    async with playwright_api.async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            await chromium.close()


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    fake = FakeProvider().start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
async def nenv(renv: ResilienceEnv) -> AsyncIterator[ResilienceEnv]:
    async with await psycopg.AsyncConnection.connect(
        renv.database_url, autocommit=True, options=f"-c search_path={renv.schema}"
    ) as conn:
        await conn.execute(SCHEMA_SQL)
    yield renv


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(env: ResilienceEnv, app: App, **options: Any) -> contextlib.AbstractAsyncContextManager[str]:
    """The console for ``env``'s schema and broker and ``app``'s queues, on 127.0.0.1 in this event
    loop; yields its base URL."""
    settings = Settings(database_url=env.database_url, broker_url=env.rabbitmq_url, db_schema=env.schema)
    return serve_settings(settings, app, **options)


@contextlib.asynccontextmanager
async def serve_settings(settings: Settings, app: App, **options: Any) -> AsyncIterator[str]:
    config = ConsoleConfig(settings=settings, app=app, token=TOKEN, actor="ops@example", **options)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(15):
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.02)  # polling uvicorn's started flag
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


@contextlib.asynccontextmanager
async def page_of(browser: Any, base: str) -> AsyncIterator[Any]:
    """A 1280x800 page that has opened the console with its token (the cookie is set)."""
    context = await browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(15_000)
    page = await context.new_page()
    try:
        response = await page.goto(f"{base}/?token={TOKEN}")
        assert response is not None and response.status == 200
        assert "token=" not in page.url  # taken out of the address bar
        yield page
    finally:
        await context.close()


async def screenshot(page: Any, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(Path(SCREENSHOTS) / f"{name}.png"))


def welcome(user_id: int) -> bytes:
    return SendWelcome(user_id=user_id, email=f"user{user_id}@example.test").model_dump_json().encode()


def notifications(queue: str, handler: Any) -> App:
    app = App("notifications-test")
    app.subscribe(queue, handler)
    return app


async def control(provider: FakeProvider, **settings: Any) -> None:
    async with httpx.AsyncClient(base_url=provider.url) as client:
        (await client.post("/_control", json=settings)).raise_for_status()


async def redrive_group_from_page(
    page: Any, base: str, queue: str, reason: str, expected: int, *, shoot: bool = False
) -> None:
    """Dead letters page: the group's dry run says ``expected``, then "Redrive N now"."""
    await page.goto(f"{base}/dead-letters")
    group = page.locator(f'section[data-queue="{queue}"] div.group[data-reason="{reason}"]')
    assert await group.locator("h3 .count").inner_text() == str(expected)
    await group.get_by_role("button", name="Dry run: redrive this group").click()
    confirm = page.locator("form.confirm")
    await confirm.wait_for()
    assert f"{expected} dead letter(s)" in await confirm.inner_text()
    if shoot:
        await screenshot(page, "dead-letters-dry-run")
    await confirm.get_by_role("button", name=f"Redrive {expected} now").click()
    await page.locator(".flash.ok", has_text="redrove").wait_for()
    assert f"redrove {expected}, kept 0, failed 0" in await page.locator(".flash.ok").inner_text()
    assert page.url == f"{base}/dead-letters"


# -- resolve a parked operation from the page ----------------------------------------------------------


async def test_an_operator_resolves_a_parked_operation_on_the_page_and_its_redrive_is_a_duplicate(
    nenv: ResilienceEnv, provider: FakeProvider, browser: Any
) -> None:
    """The provider cannot be asked: the operation is parked and its message dead-lettered. On
    "Needs a decision" the operator sees its evidence and downstream key, marks it done with a
    note; the parked message, redriven from "Dead letters", answers as a duplicate: one e-mail."""
    await control(provider, slow_sends=1, delay=3.0, lookups_down=True)
    app = notifications(nenv.queue, WelcomeEmailHandler(ProviderClient(provider.url, timeout=0.5)))
    async with nenv.run(app, **LEASED), serve(nenv, app) as base, page_of(browser, base) as page:
        await nenv.send(welcome(14), message_type="SendWelcome")
        await nenv.outcomes_until(lambda seen: count(seen, Outcome.UNCERTAIN) == 1, timeout=30)

        await page.goto(f"{base}/decisions")
        card = page.locator('section.card[data-key="welcome-14"]')
        text = await card.inner_text()
        assert "default/email.welcome/v1" in text and "Reconciled.unknown" in text
        assert downstream_key("default/email.welcome/v1", "welcome-14", "send") in text
        assert await card.locator("table.evidence tbody tr").count() == 1  # the "send" intent
        await screenshot(page, "needs-a-decision")

        await card.get_by_label("Mark done").check()
        await card.get_by_role("button", name="Record decision").click()  # no note: the browser refuses
        assert (await nenv.rows("SELECT state FROM operations"))[0][0] == "needs_reconciliation"
        await card.locator("textarea[name=note]").fill("msg-1 seen in the provider's dashboard")
        await card.get_by_role("button", name="Record decision").click()
        await page.locator(".flash.ok").wait_for()
        assert "welcome-14: completed (resolved by ops@example)" in await page.locator(".flash.ok").inner_text()
        assert page.url == f"{base}/decisions"  # not the action's URL: a reload shows the page
        assert await page.locator('section.card[data-key="welcome-14"]').count() == 0

        await redrive_group_from_page(page, base, nenv.queue, "needs_reconciliation", 1)
        (redriven,) = await nenv.next_reports(1)
        await page.goto(f"{base}/audit")
        audit = await page.locator("table.audit tbody").inner_text()
        await screenshot(page, "audit")
    assert redriven.outcome is Outcome.DUPLICATE
    assert len(provider.sent) == 1
    assert await nenv.rows("SELECT state, resolved_by, resolution_note FROM operations") == [
        ("completed", "ops@example", "msg-1 seen in the provider's dashboard")
    ]
    actions = await nenv.rows("SELECT actor, source, action, outcome FROM audit ORDER BY id")
    assert actions == [
        ("ops@example", "console", "resolve", "completed"),
        ("ops@example", "console", "redrive_dry_run", "started"),  # recorded before it acts
        ("ops@example", "console", "redrive_dry_run", "would redrive 1, kept 0, failed 0"),
        ("ops@example", "console", "redrive", "started"),
        ("ops@example", "console", "redrive", "redrove 1, kept 0, failed 0"),
    ]
    assert "resolve" in audit and "redrove 1" in audit


def _fingerprint(user_id: int) -> str:
    message = SendWelcome.model_validate_json(welcome(user_id))
    fingerprint = WelcomeEmailHandler().fingerprint_under(message, 1)
    assert fingerprint is not None
    return fingerprint


async def park(env: ResilienceEnv, key: str, fingerprint: str, scope: str = "default/email.welcome/v1",
               **evidence: Any) -> None:
    """A parked operation as a dead worker's reconcile left it (``Reconciled.unknown``), with one
    evidence record of call ``send``."""
    operation_type = scope.split("/")[1]
    await env.rows(
        "INSERT INTO operations (scope, key, tenant, operation_type, fingerprint, projection_version, state, "
        "attempts, error_class, error_detail, watch_since) VALUES (%s, %s, 'default', %s, %s, 1, "
        "'needs_reconciliation', 2, 'Reconciled.unknown', 'the provider could not be asked', now()) RETURNING 1",
        scope, key, operation_type, fingerprint,
    )
    await env.rows(
        "INSERT INTO evidence (scope, key, name, attempt, worker, facts) VALUES (%s, %s, 'send', 1, 'w:1', %s) "
        "RETURNING 1", scope, key, psycopg.types.json.Jsonb({"intent": "welcome", **evidence}),
    )


async def test_not_done_from_the_page_runs_the_operation_again_with_the_same_downstream_key(
    nenv: ResilienceEnv, provider: FakeProvider, browser: Any
) -> None:
    """The operator checked the provider: nothing was sent. "Mark not done" reopens the operation;
    its next delivery takes it over without asking reconcile (which would park it again) and
    sends once, with the same downstream key."""
    await park(nenv, "welcome-21", _fingerprint(21))
    app = notifications(nenv.queue, WelcomeEmailHandler(ProviderClient(provider.url)))
    async with nenv.run(app, **LEASED), serve(nenv, app) as base, page_of(browser, base) as page:
        await page.goto(f"{base}/decisions")
        card = page.locator('section.card[data-key="welcome-21"]')
        await card.get_by_label("Mark not done").check()
        await card.locator("textarea[name=note]").fill("no such reference in the provider's log")
        await card.get_by_role("button", name="Record decision").click()
        await page.locator(".flash.ok").wait_for()
        assert "welcome-21: processing" in await page.locator(".flash.ok").inner_text()
        await nenv.send(welcome(21), message_type="SendWelcome")  # the redelivery
        reports = await nenv.outcomes_until(lambda seen: count(seen, Outcome.LEASE_RECOVERED) == 1, timeout=30)
    assert [r.outcome for r in reports] == [Outcome.LEASE_RECOVERED]
    assert [m["reference"] for m in provider.sent] == [downstream_key("default/email.welcome/v1", "welcome-21", "send")]
    assert await nenv.rows("SELECT state, attempts FROM operations") == [("completed", 3)]


async def test_a_live_lease_is_refused_on_the_page_as_the_cli_refuses_it(
    nenv: ResilienceEnv, browser: Any
) -> None:
    """The operation was parked when the page was drawn; a worker has taken it since (a live
    lease). The decision is refused with the CLI's reason, audited, and the row is untouched."""
    await park(nenv, "welcome-22", _fingerprint(22))
    app = notifications(nenv.queue, WelcomeEmailHandler())
    async with serve(nenv, app) as base, page_of(browser, base) as page:
        await page.goto(f"{base}/decisions")
        card = page.locator('section.card[data-key="welcome-22"]')
        await nenv.rows("UPDATE operations SET state = 'processing', lease_owner = 'w:2:x', "
                        "lease_expires_at = now() + interval '1 hour' RETURNING 1")
        await card.get_by_label("Mark failed").check()
        await card.locator("textarea[name=note]").fill("refund issued")
        await card.get_by_role("button", name="Record decision").click()
        await page.locator(".flash.bad").wait_for()
        refusal = await page.locator(".flash.bad").inner_text()
    assert "is processing under a live lease" in refusal and "never overruled" in refusal
    assert await nenv.rows("SELECT state, lease_owner FROM operations") == [("processing", "w:2:x")]
    assert await nenv.rows("SELECT action, outcome FROM audit") == [("resolve", "refused")]


# -- redrive a group of dead letters ------------------------------------------------------------------


class Gated(CreateInvoiceHandler):
    """Fails every attempt while ``open`` is false (the downstream is down)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = False

    async def handle(self, message: CreateInvoice, ctx: Context) -> Any:
        if not self.open:
            raise RetryableError("ledger service down")
        return await super().handle(message, ctx)


def terminal(n: int) -> Any:
    return lambda seen: sum(r.outcome in (Outcome.EXECUTED, Outcome.DUPLICATE, Outcome.DEAD_LETTERED)
                            for r in seen) == n


async def test_a_group_of_dead_letters_redriven_from_the_page_executes_each_once(
    renv: ResilienceEnv, browser: Any
) -> None:
    """Six commands dead-letter while the downstream is down (``max_deliveries=1``). On "Dead
    letters" they are one group with their operation keys and no bodies; its dry run moves
    nothing; the redrive sends all six back and each executes exactly once."""
    handler = Gated()
    app = App("gated")
    app.subscribe(renv.queue, handler)
    async with renv.run(app, max_deliveries=1), serve(renv, app) as base, page_of(browser, base) as page:
        for order in range(1, 7):
            await renv.send(command(order_id=order))
        dead = await renv.reports_until(terminal(6))
        assert {r.outcome for r in dead} == {Outcome.DEAD_LETTERED}
        handler.open = True

        await page.goto(f"{base}/dead-letters")
        group = page.locator('div.group[data-reason="max_deliveries_exceeded:RetryableError"]')
        text = await group.inner_text()
        assert all(f"order-{n}-rev-2" in text for n in range(1, 7))
        assert "c-1" not in text and "amount_cents" not in text  # no body unless asked
        last = await group.locator("tbody tr td:nth-child(5)").all_inner_texts()  # the ledger's last fault
        assert len(last) == 6 and all(re.fullmatch(r"\d+s ago", cell) for cell in last), last
        assert "- ago" not in text
        await screenshot(page, "dead-letters")
        await group.get_by_role("button", name="body").first.click()
        body = await page.locator("pre.body").inner_text()
        assert '"amount_cents"' in body
        await screenshot(page, "dead-letter-body")

        await redrive_group_from_page(page, base, renv.queue, "max_deliveries_exceeded:RetryableError", 6, shoot=True)
        redriven = await renv.reports_until(terminal(6))
        await page.goto(f"{base}/dead-letters")
        assert "No dead letters." in await page.locator(f'section[data-queue="{renv.queue}"]').inner_text()
        await page.goto(f"{base}/pressure")
        assert "invoice.create" in await page.locator("table.pressure").first.inner_text()
        await screenshot(page, "pressure")
    assert sorted(r.operation_key for r in redriven) == sorted(f"order-{n}-rev-2" for n in range(1, 7))
    assert {r.outcome for r in redriven} == {Outcome.EXECUTED}
    assert await renv.rows("SELECT count(*), count(DISTINCT order_id) FROM invoices") == [(6, 6)]
    assert [a for (a,) in await renv.rows("SELECT action FROM audit ORDER BY id")] == [
        "show_body", "redrive_dry_run", "redrive_dry_run", "redrive", "redrive"]  # started, then outcome


async def test_dead_letters_on_sqs_are_grouped_and_redriven_from_the_page(
    sqs_endpoint: str, database_url: str, unique_name: str, browser: Any,  # noqa: F811
) -> None:
    """The same page on SQS (moto server): four dead letters in the queue's redrive-policy DLQ, one
    group; dry run, then redrive: each executed once."""
    driver = SQSDriver(f"{unique_name}.commands", sqs_endpoint)
    await driver.open()
    try:
        async with throwaway_schema(database_url) as schema:
            case = Contract(driver, database_url, schema)
            handler = Gated()
            app = case.app(handler)
            async with case.worker(handler, max_deliveries=1), \
                    serve_settings(case.settings(), app) as base, page_of(browser, base) as page:
                for order in range(1, 5):
                    await driver.send(command(order_id=order), {"operation-id": f"order-{order}-rev-2"})
                dead = await case.reports_until(terminal(4), timeout=60)
                assert {r.outcome for r in dead} == {Outcome.DEAD_LETTERED}
                handler.open = True
                await redrive_group_from_page(page, base, driver.queue, "max_deliveries_exceeded:RetryableError", 4)
                redriven = await case.reports_until(terminal(4), timeout=60)
            assert {r.outcome for r in redriven} == {Outcome.EXECUTED}
            assert await case.rows("SELECT count(*), count(DISTINCT order_id) FROM invoices") == [(4, 4)]
    finally:
        await driver.close()


async def test_dead_letters_on_service_bus_are_grouped_and_redriven_from_the_page(
    sb_server: ServiceBusTestServer, database_url: str, unique_name: str, browser: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same page on Service Bus (the real SDK against tests/adapters/servicebus/server): three dead
    letters in ``<queue>/$DeadLetterQueue``, one group; dry run, then redrive: each executed once."""
    monkeypatch.setenv("CONSUMER_KIT_SERVICEBUS_CONNECTION_STRING", sb_server.connection_string)
    monkeypatch.setenv("CONSUMER_KIT_SERVICEBUS_RECEIVE_WAIT", "0.5")
    driver = ServiceBusDriver(f"{unique_name}.commands", sb_server)
    await driver.open()
    try:
        async with throwaway_schema(database_url) as schema:
            case = Contract(driver, database_url, schema)
            handler = Gated()
            app = case.app(handler)
            async with case.worker(handler, max_deliveries=1), \
                    serve_settings(case.settings(), app) as base, page_of(browser, base) as page:
                for order in range(1, 4):
                    await driver.send(command(order_id=order), {"operation-id": f"order-{order}-rev-2"})
                dead = await case.reports_until(terminal(3), timeout=60)
                assert {r.outcome for r in dead} == {Outcome.DEAD_LETTERED}
                handler.open = True
                await redrive_group_from_page(page, base, driver.queue, "max_deliveries_exceeded:RetryableError", 3)
                redriven = await case.reports_until(terminal(3), timeout=60)
            assert {r.outcome for r in redriven} == {Outcome.EXECUTED}
            assert await case.rows("SELECT count(*), count(DISTINCT order_id) FROM invoices") == [(3, 3)]
    finally:
        await driver.close()


# -- safe by default ----------------------------------------------------------------------------------


async def test_requests_without_the_token_are_refused(renv: ResilienceEnv, browser: Any) -> None:
    async with serve(renv, App("empty")) as base:
        context = await browser.new_context()
        page = await context.new_page()
        for path in ("/", "/decisions", "/dead-letters", "/pressure", "/audit", "/static/htmx.min.js",
                     "/?token=wrong-" + TOKEN):
            response = await page.goto(base + path)
            assert response is not None and response.status == 401, path
            assert "needs its token" in await page.locator("body").inner_text()
        await context.close()
        async with httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/decisions", headers={"Authorization": "Bearer nope"})).status_code == 401
            assert (await client.get("/decisions", headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 200
            refused = await client.post("/decisions/resolve", data={"scope": "s", "key": "k"})
            assert refused.status_code == 401


async def test_a_forged_post_without_the_csrf_token_is_refused(renv: ResilienceEnv, browser: Any) -> None:
    """The browser holds the console's cookie; a POST built by a script without the form's CSRF
    token, one with another token, and one from another origin are all refused (403), and the
    parked operation stays parked."""
    await park(renv, "order-9-rev-2", "f" * 64, scope="default/invoice.create/v1")
    form = {"scope": "default/invoice.create/v1", "key": "order-9-rev-2", "decision": "completed", "note": "forged"}
    async with serve(renv, App("empty")) as base, page_of(browser, base) as page:
        await page.goto(f"{base}/decisions")
        statuses = await page.evaluate(
            """async ([form, csrf]) => {
                const post = async (extra) => (await fetch('/decisions/resolve', {method: 'POST',
                    body: new URLSearchParams({...form, ...extra})})).status;
                return [await post({}), await post({csrf: 'not-the-token'}), await post({csrf})];
            }""",
            [form, await page.locator("input[name=csrf]").first.get_attribute("value")],
        )
        csrf = await page.locator("input[name=csrf]").first.get_attribute("value")
    assert statuses[:2] == [403, 403]
    assert statuses[2] == 200  # the page's own token works: the refusals were for the token
    await renv.rows("UPDATE operations SET state = 'needs_reconciliation' RETURNING 1")
    async with serve(renv, App("empty")) as base, httpx.AsyncClient(base_url=base) as client:
        cross = await client.post("/decisions/resolve", data={**form, "csrf": csrf}, headers={
            "Authorization": f"Bearer {TOKEN}", "Origin": "https://evil.example"})
        assert cross.status_code == 403  # another origin (and another process's CSRF key)
    assert await renv.rows("SELECT state FROM operations") == [("needs_reconciliation",)]


async def test_keys_and_evidence_with_markup_and_script_render_as_text(renv: ResilienceEnv, browser: Any) -> None:
    await park(renv, HOSTILE_KEY, "f" * 64, scope="default/<i>invoice.create</i>/v1", note="<script>window.pwned = 3</script>")
    await park(renv, "invoice-\u202egpj.exe", "f" * 64, scope="default/invoice.create/v1")
    async with serve(renv, App("empty")) as base, page_of(browser, base) as page:
        await page.goto(f"{base}/decisions")
        heading = page.locator("section.card h2").first
        assert await heading.locator(".key").inner_text() == HOSTILE_KEY
        assert await heading.locator("b, img, script, i").count() == 0
        assert "<script>window.pwned = 3</script>" in await page.locator("table.evidence").first.inner_text()
        bidi = page.locator("section.card h2 .key", has_text="gpj.exe")
        assert await bidi.inner_text() == "invoice-\\u202egpj.exe"  # reads one way only, as in the CLI
        assert await page.evaluate("window.pwned") is None
        assert await page.locator("main script, main img").count() == 0
        await page.goto(f"{base}/audit")
        assert await page.evaluate("window.pwned") is None


async def test_read_only_mode_shows_no_actions_and_refuses_every_post(renv: ResilienceEnv, browser: Any) -> None:
    await park(renv, "order-5-rev-2", "f" * 64, scope="default/invoice.create/v1")
    async with serve(renv, App("empty"), read_only=True) as base, page_of(browser, base) as page:
        await page.goto(f"{base}/decisions")
        assert await page.locator("section.card").count() == 1
        assert await page.locator("form").count() == 0
        assert "read-only" in await page.locator("header").inner_text()
        status = await page.evaluate("""async () => (await fetch('/decisions/resolve', {method: 'POST',
            body: new URLSearchParams({scope: 'default/invoice.create/v1', key: 'order-5-rev-2',
            decision: 'completed', note: 'x'})})).status""")
        await page.goto(f"{base}/pressure")
        pressure = await page.locator("table.pressure").first.inner_text()
    assert status == 403
    assert "invoice.create" in pressure
    assert await renv.rows("SELECT state FROM operations") == [("needs_reconciliation",)]


async def test_behind_a_proxy_its_user_header_authenticates_and_is_the_audited_actor(renv: ResilienceEnv) -> None:
    """With ``user_header``, the proxy's header is the identity (and the token is not enough on its
    own): no header, 401; the user's POST with the page's CSRF token resolves and is audited as
    that user; another user's CSRF token does not work for them."""
    await park(renv, "order-6-rev-2", "f" * 64, scope="default/invoice.create/v1")
    secret = "proxy-secret-" + "y" * 20
    async with serve(renv, App("empty"), user_header="X-Forwarded-User", proxy_secret=secret) as base, \
            httpx.AsyncClient(base_url=base, headers={"X-Console-Proxy-Secret": secret}) as client:
        assert (await client.get("/decisions")).status_code == 401
        assert (await client.get("/decisions", headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 401
        alice, mallory = {"X-Forwarded-User": "alice@corp"}, {"X-Forwarded-User": "mallory@corp"}
        page = await client.get("/decisions", headers=alice)
        assert page.status_code == 200 and "alice@corp" in page.text
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
        assert csrf is not None
        form = {"scope": "default/invoice.create/v1", "key": "order-6-rev-2", "decision": "failed",
                "note": "refunded by hand", "csrf": csrf[1]}
        assert (await client.post("/decisions/resolve", data=form, headers=mallory)).status_code == 403
        resolved = await client.post("/decisions/resolve", data=form, headers=alice)
        assert resolved.status_code == 200 and "order-6-rev-2: failed" in resolved.text
    assert await renv.rows("SELECT state, resolved_by FROM operations") == [("failed", "alice@corp")]
    assert await renv.rows("SELECT actor, source, outcome FROM audit") == [("alice@corp", "console", "failed")]


async def test_the_cli_refuses_a_live_lease_with_the_pages_words_and_audits_it(renv: ResilienceEnv) -> None:
    """``consumer-kit ledger resolve`` and the page run one function: the same refusal, audited
    with source ``cli``."""
    await park(renv, "order-7-rev-2", "f" * 64, scope="default/invoice.create/v1")
    await renv.rows("UPDATE operations SET state = 'processing', lease_owner = 'w:2:x', "
                    "lease_expires_at = now() + interval '1 hour' RETURNING 1")
    result = await asyncio.to_thread(
        CliRunner().invoke, cli,
        ["ledger", "resolve", "default/invoice.create/v1", "order-7-rev-2", "--completed", "--note", "seen", "--by", "ops"],
        env={"CONSUMER_KIT_DATABASE_URL": renv.database_url, "CONSUMER_KIT_DB_SCHEMA": renv.schema, "COLUMNS": "250"},
    )
    assert result.exit_code == 2
    assert "is processing under a live lease" in result.output and "never overruled" in result.output
    assert await renv.rows("SELECT actor, source, action, outcome FROM audit") == [("ops", "cli", "resolve", "refused")]
    assert await renv.rows("SELECT state FROM operations") == [("processing",)]
