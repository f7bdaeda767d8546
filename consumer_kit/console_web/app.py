"""The console's pages and actions (Starlette): Needs a decision, Dead letters, Pressure, Audit.

Every action goes through :mod:`consumer_kit.ops.operator_actions`, the code ``consumer-kit ledger
resolve`` and ``consumer-kit dlq redrive`` run, and is written to the audit table. Producer text
(keys, ids, reasons, details, bodies) reaches the page only through Jinja's autoescaping.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any

import jinja2
import markupsafe
import psycopg
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from consumer_kit.app import App
from consumer_kit.codec.plain_text import escape_controls
from consumer_kit.codec.redaction import redact, redact_url
from consumer_kit.console_web.security import COOKIE, CSRF_FIELD, LOCAL_NAMES, Guard, Identity, same_origin
from consumer_kit.db.pooler import connect_options
from consumer_kit.errors import ConfigurationError, Refused
from consumer_kit.identity import downstream_key
from consumer_kit.ledger.audit import AuditLog
from consumer_kit.ledger.inspect import DECISIONS, LedgerInspector, OperationDetail
from consumer_kit.model.evidence import OPERATOR_EVIDENCE
from consumer_kit.model.operation_row import NEEDS_RECONCILIATION
from consumer_kit.ops.audit_trail import AuditTrail
from consumer_kit.ops.operator_actions import (
    Group,
    Selection,
    dead_letter_rows,
    default_actor,
    group_dead_letters,
    handler_for_scope,
    ledger_url,
    open_dead_letter_queues,
    operation_key,
    redrive_dead_letters,
    resolve_parked,
)
from consumer_kit.ops.stats import StatsReader, age_text, ago_text, duration_text
from consumer_kit.settings import Settings

logger = logging.getLogger("consumer_kit.console")

PRESSURE_WINDOW = 3600.0
"""The Pressure page's window in seconds (the last hour)."""


@dataclass
class ConsoleConfig:
    """What a console serves.

    Attributes:
        settings: the deployment's settings (database, schema, broker).
        app: the App whose queues' dead letters are shown and whose handlers compute operation keys.
        token: the secret every request must carry (unless ``user_header`` is set).
        user_header: trust this header, set by an authenticating reverse proxy, as the user's name
            (only on a request proven to come from that proxy: ``proxy_secret``, ``trusted_proxies``).
        proxy_secret: the secret the proxy sends in ``X-Console-Proxy-Secret``.
        trusted_proxies: the proxy's source addresses or networks.
        served_names: the host names the console answers to (default: localhost's).
        read_only: show everything, change nothing (every POST is refused).
        actor: who the token holder is in the audit table (default ``user@host``).
        peek_limit: at most this many dead letters read per queue for a page.
        queues: the queues shown (default: the app's).
        relay_max_attempts: the relay's parking bound (an outbox row with this many failed
            attempts is parked), as ``consumer-kit stats --max-attempts``.
    """

    settings: Settings
    app: App | None
    token: str
    user_header: str | None = None
    proxy_secret: str | None = None
    trusted_proxies: list[str] = field(default_factory=list)
    served_names: list[str] = field(default_factory=lambda: list(LOCAL_NAMES))
    read_only: bool = False
    actor: str = field(default_factory=default_actor)
    peek_limit: int = 1000
    queues: list[str] = field(default_factory=list)
    relay_max_attempts: int = 20

    def shown_queues(self) -> list[str]:
        return self.queues or (self.app.queues if self.app is not None else [])


def _environment() -> jinja2.Environment:
    """Autoescape on for every template: keys, ids, reasons, details and bodies are producer text.
    Every string shown also has its control and bidi characters written as escapes (``\u202e``),
    as the CLI prints them, so it reads one way only; a form's hidden value (``|formvalue``) is
    only HTML-escaped, so it posts back exactly what was read."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("consumer_kit.console_web", "templates"), autoescape=True,
        undefined=jinja2.StrictUndefined, finalize=_shown,
    )
    env.filters["formvalue"] = lambda value: markupsafe.escape("" if value is None else value)
    env.filters["json"] = lambda value: json.dumps(value, ensure_ascii=False, default=str)
    return env


def _shown(value: Any) -> Any:
    if isinstance(value, markupsafe.Markup) or not isinstance(value, str):
        return value
    return escape_controls(value)


def create_app(config: ConsoleConfig) -> Starlette:
    """The console as an ASGI application (serve it with uvicorn on 127.0.0.1)."""
    console = _Console(config)
    routes = [
        Route("/", console.home),
        Route("/decisions", console.decisions),
        Route("/decisions/resolve", console.resolve, methods=["POST"]),
        Route("/dead-letters", console.dead_letters),
        Route("/dead-letters/redrive", console.redrive, methods=["POST"]),
        Route("/dead-letters/body", console.body, methods=["POST"]),
        *(Route(action, _back_to(action.rsplit("/", 1)[0]), methods=["GET"])
          for action in ("/decisions/resolve", "/dead-letters/redrive", "/dead-letters/body")),
        Route("/pressure", console.pressure),
        Route("/audit", console.audit),
        Mount("/static", StaticFiles(directory=str(files("consumer_kit.console_web") / "static")), name="static"),
    ]
    return Starlette(
        routes=routes, middleware=[Middleware(_Gate, guard=console.guard, read_only=config.read_only)],
        exception_handlers={psycopg.Error: _unavailable, ConfigurationError: _unavailable,
                            ConnectionError: _unavailable},
    )


def _back_to(page: str) -> Callable[[Request], Awaitable[Response]]:
    """A GET of an action's URL (a reload after a plain form POST): back to its page."""

    async def redirect(request: Request) -> Response:
        return RedirectResponse(page, status_code=303)

    return redirect


async def _unavailable(request: Request, exc: Exception) -> Response:
    """The database or broker cannot be used: say so on one line (as the CLI's ``error:``)."""
    text = redact((str(exc).strip() or type(exc).__name__).splitlines()[0])  # libpq may quote the URL
    if isinstance(exc, psycopg.errors.UndefinedTable | psycopg.errors.InvalidSchemaName):
        text += ": run `consumer-kit migrate` first (and check CONSUMER_KIT_DB_SCHEMA)"
    logger.warning("console: %s failed: %s", request.url.path, text)
    return _secured(PlainTextResponse(f"503: {text}", status_code=503))


class _Gate(BaseHTTPMiddleware):
    """Authentication on every request; CSRF, same origin and read-only on every POST."""

    def __init__(self, app: Any, guard: Guard, read_only: bool) -> None:
        super().__init__(app)
        self.guard = guard
        self.read_only = read_only

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if not self.guard.host_ok(request):
            logger.warning("console: refused a request for a host it does not serve")
            return _secured(PlainTextResponse(
                "421: this console does not serve that host name (see CONSUMER_KIT_CONSOLE_SERVED_NAMES)",
                status_code=421,
            ))
        identity = self.guard.identify(request)
        if identity is None:
            return _secured(PlainTextResponse(
                "401: this console needs its token (open the URL it printed at start) or, behind the "
                "configured proxy, the proxy's user header", status_code=401,
            ))
        request.state.identity = identity
        if request.method not in ("GET", "HEAD"):
            if request.method != "POST":
                return _secured(PlainTextResponse("405: GET or POST only", status_code=405))
            if self.read_only:
                return _secured(PlainTextResponse("403: this console is read-only", status_code=403))
            # the CSRF token is checked by each POST endpoint (``_post``): a body read here would
            # not reach the endpoint
        if request.method == "GET" and "token" in request.query_params and identity.user is None:
            # the token came in the URL: keep it in a cookie and take it out of the address bar
            # one leading slash: ``//evil.example/`` would be another site's address
            response: Response = RedirectResponse("/" + request.url.path.lstrip("/"), status_code=303)
            response.set_cookie(COOKIE, self.guard.token, httponly=True, samesite="strict",
                                secure=request.url.scheme == "https")
            return _secured(response)
        return _secured(await call_next(request))


def _secured(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    )
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-store"
    return response


Endpoint = Callable[["_Console", Request], Awaitable[Response]]


def _post(endpoint: Endpoint) -> Endpoint:
    """A state-changing endpoint: refused (403) unless the form carries the CSRF token of the
    request's identity and the request names no other origin."""

    @functools.wraps(endpoint)
    async def checked(console: _Console, request: Request) -> Response:
        identity: Identity = request.state.identity
        offered = (await request.form()).get(CSRF_FIELD)
        if not same_origin(request) or not console.guard.csrf_ok(identity, offered if isinstance(offered, str) else None):
            logger.warning("console: refused a POST to %s without a valid CSRF token", request.url.path)
            return PlainTextResponse("403: missing or wrong CSRF token", status_code=403)
        response = await endpoint(console, request)
        # the address bar shows the page the answer is (a boosted POST would push the action's URL)
        response.headers["HX-Push-Url"] = request.url.path.rsplit("/", 1)[0]
        return response

    return checked


class _Console:
    def __init__(self, config: ConsoleConfig) -> None:
        self.config = config
        self.settings = config.settings
        self.schema = config.settings.db_schema
        self.guard = Guard(config.token, config.user_header, proxy_secret=config.proxy_secret,
                           trusted_proxies=config.trusted_proxies, served_names=config.served_names)
        self.templates = _environment()
        self.inspector = LedgerInspector(self.schema)
        self.audit_log = AuditLog(self.schema)

    # -- plumbing ----------------------------------------------------------------------------------

    def _connect(self) -> Any:
        url = ledger_url(self.settings)  # "embedded": the embedded server the worker used
        if url is None:
            raise Refused("no database: set CONSUMER_KIT_DATABASE_URL")
        return psycopg.AsyncConnection.connect(url, autocommit=True, **connect_options(self.settings))

    def actor(self, request: Request) -> str:
        identity: Identity = request.state.identity
        return identity.user or self.config.actor

    def render(self, request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
        identity: Identity = request.state.identity
        html = self.templates.get_template(template).render(
            csrf=self.guard.csrf_token(identity), csrf_field=CSRF_FIELD, read_only=self.config.read_only,
            actor=self.actor(request), schema=self.schema, page=template.removesuffix(".html"),
            broker=_broker_label(self.settings), now=dt.datetime.now(dt.UTC), ago=ago_text, seconds=age_text,
            duration=duration_text, **{"message": None, "error": None, "pending": None, **context},
        )
        return HTMLResponse(html, status_code=status_code)

    def _trail(self, request: Request) -> AuditTrail:
        return AuditTrail(self.settings, self.actor(request), "console")

    async def _record(self, request: Request, action: str, target: str, outcome: str, note: str = "",
                      **details: Any) -> None:
        await self._trail(request).record(action, target, outcome, note, **details)

    # -- pages -------------------------------------------------------------------------------------

    async def home(self, request: Request) -> Response:
        return RedirectResponse("/decisions", status_code=303)

    async def decisions(self, request: Request, message: str | None = None, error: str | None = None,
                        status_code: int = 200) -> Response:
        async with await self._connect() as conn:
            parked = await self.inspector.list(conn, NEEDS_RECONCILIATION, limit=200)
            details = [await self.inspector.show(conn, row.scope, row.key) for row in parked]
        operations = [_Decision.of(detail, self.config.app) for detail in details if detail is not None]
        return self.render(request, "decisions.html", status_code, operations=operations, message=message,
                           error=error, decisions=DECISIONS)

    @_post
    async def resolve(self, request: Request) -> Response:
        form = await request.form()
        scope, key = str(form.get("scope", "")), str(form.get("key", ""))
        decision, note = str(form.get("decision", "")), str(form.get("note", ""))
        try:
            async with await self._connect() as conn:
                state = await resolve_parked(
                    conn, self.schema, scope, key, decision=decision, note=note, by=self.actor(request),
                    source="console", app=self.config.app,
                )
        except Refused as refused:
            return await self.decisions(request, error=str(refused), status_code=409)
        return await self.decisions(request, message=f"{scope} {key}: {state} (resolved by {self.actor(request)}). "
                                    "Redrive its parked message from Dead letters.")

    async def dead_letters(self, request: Request, status_code: int = 200, **extra: Any) -> Response:
        queues: list[dict[str, Any]] = []
        async with open_dead_letter_queues(self.settings) as dead:
            for queue in self.config.shown_queues():
                try:
                    total = await dead.count(queue)
                    letters = await dead.peek(queue, limit=self.config.peek_limit)
                except (ConfigurationError, ConnectionError, OSError) as exc:
                    queues.append({"name": queue, "error": redact(str(exc)) or type(exc).__name__, "groups": [], "total": 0})
                    continue
                groups: list[Group] = group_dead_letters(
                    await dead_letter_rows(self.settings, self.config.app, letters)
                )
                queues.append({"name": queue, "total": total, "shown": len(letters), "groups": groups, "error": None})
        return self.render(request, "dead_letters.html", status_code, queues=queues, **extra)

    @_post
    async def redrive(self, request: Request) -> Response:
        form = await request.form()
        queue = str(form.get("queue", ""))
        reason = str(form.get("reason", "")) or None
        message_id = str(form.get("message_id", "")) or None
        dry_run = form.get("dry_run") == "1"
        if queue not in self.config.shown_queues():
            return await self.dead_letters(request, 400, error=f"{queue!r} is not one of this console's queues")
        try:
            selection = Selection(reason=reason, message_id=message_id)
        except Refused as refused:
            return await self.dead_letters(request, 400, error=str(refused))
        target = f"{queue} {selection.describe()}"
        verb = "would redrive" if dry_run else "redrove"
        # audited before the move (a failure part-way leaves the attempt recorded), then its outcome
        async with self._trail(request).around("redrive_dry_run" if dry_run else "redrive", target, queue=queue,
                                               reason=reason, message_id=message_id) as result, \
                open_dead_letter_queues(self.settings) as dead:
            outcome = await redrive_dead_letters(dead, queue, selection, app=self.config.app, dry_run=dry_run)
            report = outcome.report
            summary = f"{verb} {report.redriven}, kept {report.kept}, failed {report.failed}"
            result.update(outcome=summary, redriven=report.redriven, kept=report.kept, failed=report.failed)
        pending = {"queue": queue, "reason": reason or "", "message_id": message_id or "",
                   "count": report.redriven, "what": selection.describe()} if dry_run and report.redriven else None
        # a dry run that found some shows its count in the confirmation box, not as a done deed
        message = None if pending else f"{queue}, {selection.describe()}: {summary}"
        return await self.dead_letters(request, message=message, pending=pending)

    @_post
    async def body(self, request: Request) -> Response:
        form = await request.form()
        queue, message_id = str(form.get("queue", "")), str(form.get("message_id", ""))
        if queue not in self.config.shown_queues():
            return await self.dead_letters(request, 400, error=f"{queue!r} is not one of this console's queues")
        async with open_dead_letter_queues(self.settings) as dead:
            letters = await dead.peek(queue, limit=self.config.peek_limit)
        found = next((letter for letter in letters if letter.message_id == message_id), None)
        await self._record(request, "show_body", f"{queue} {message_id}", "shown" if found else "not found")
        if found is None:
            return await self.dead_letters(request, 404, error=f"no dead letter {message_id} in {queue}")
        return self.render(request, "body.html", queue=queue, letter=found, key=operation_key(self.config.app, found),
                           body=found.body.decode("utf-8", "replace"))

    async def pressure(self, request: Request) -> Response:
        reader = StatsReader(self.schema, max_attempts=self.config.relay_max_attempts)
        async with await self._connect() as conn:
            stats = await reader.read(conn, since=PRESSURE_WINDOW)
        return self.render(request, "pressure.html", stats=stats, window="1h")

    async def audit(self, request: Request) -> Response:
        async with await self._connect() as conn:
            entries = await self.audit_log.recent(conn, limit=200)
        return self.render(request, "audit.html", entries=entries)


@dataclass(frozen=True)
class _Decision:
    """A parked operation as the page shows it."""

    detail: OperationDetail
    downstream_keys: list[tuple[str, str]]
    reruns: bool  # "not done" can run it again (its handler has external effects, or is unknown)

    @classmethod
    def of(cls, detail: OperationDetail, app: App | None) -> _Decision:
        row = detail.summary
        names = dict.fromkeys(r.name for r in detail.evidence if r.name != OPERATOR_EVIDENCE)
        handler = handler_for_scope(app, row.scope)
        return cls(detail, [(name, downstream_key(row.scope, row.key, name)) for name in names],
                   handler is None or bool(handler.external_effects))


def _broker_label(settings: Settings) -> str:
    return redact_url(settings.broker_url) if settings.broker_url else "(no broker)"

