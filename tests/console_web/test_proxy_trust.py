"""The console behind an authenticating proxy (docs/how-to/console.md, "Behind a proxy"): the user
header is believed only on a request proven to come from the proxy (its shared secret, its source
address), with exactly one line of it; a Host the console does not serve is refused; the token's
redirect never leaves the console; no page is kept in htmx's history cache. In-process HTTP
against the real application (httpx's ASGI transport, which sets the client's address)."""

from __future__ import annotations

import re
from importlib.resources import files
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from consumer_kit import App
from consumer_kit.cli.main import cli
from consumer_kit.console_web import ConsoleConfig, create_app
from consumer_kit.settings import OperatorConsoleSettings, Settings
from tests.fixtures.resilience import ResilienceEnv

TOKEN = "test-token-" + "x" * 20
SECRET = "proxy-secret-" + "y" * 20
PAGE = "/static/console.css"  # served behind the gate, needs no database


def client(settings: Settings | None = None, address: str = "127.0.0.1", **options: Any) -> httpx.AsyncClient:
    config = ConsoleConfig(settings=settings or Settings(), app=App("empty"), token=TOKEN, actor="ops@example",
                           **options)
    transport = httpx.ASGITransport(app=create_app(config), client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8765")


async def test_a_direct_client_naming_a_user_gets_nothing_without_the_proxys_secret() -> None:
    async with client(user_header="X-Forwarded-User", proxy_secret=SECRET) as http:
        assert (await http.get(PAGE, headers={"X-Forwarded-User": "alice"})).status_code == 401
        wrong = {"X-Forwarded-User": "alice", "X-Console-Proxy-Secret": SECRET + "z"}
        assert (await http.get(PAGE, headers=wrong)).status_code == 401
        good = {"X-Forwarded-User": "alice", "X-Console-Proxy-Secret": SECRET}
        assert (await http.get(PAGE, headers=good)).status_code == 200


async def test_a_client_outside_the_trusted_proxies_is_refused_whatever_it_sends() -> None:
    async with client(address="192.0.2.7", user_header="X-Forwarded-User", trusted_proxies=["10.1.0.0/24"]) as http:
        assert (await http.get(PAGE, headers={"X-Forwarded-User": "alice"})).status_code == 401
    async with client(address="10.1.0.9", user_header="X-Forwarded-User", trusted_proxies=["10.1.0.0/24"]) as http:
        assert (await http.get(PAGE, headers={"X-Forwarded-User": "alice"})).status_code == 200
    both = {"trusted_proxies": ["10.1.0.9"], "proxy_secret": SECRET}  # both set: both must hold
    async with client(address="10.1.0.9", user_header="X-Forwarded-User", **both) as http:
        assert (await http.get(PAGE, headers={"X-Forwarded-User": "alice"})).status_code == 401


async def test_two_lines_of_the_user_header_are_refused_not_the_first_believed() -> None:
    async with client(user_header="X-Forwarded-User", proxy_secret=SECRET) as http:
        doubled = [("X-Forwarded-User", "alice"), ("X-Forwarded-User", "mallory"),
                   ("X-Console-Proxy-Secret", SECRET)]
        assert (await http.get(PAGE, headers=doubled)).status_code == 401
        two_secrets = [("X-Forwarded-User", "alice"), ("X-Console-Proxy-Secret", SECRET),
                       ("X-Console-Proxy-Secret", SECRET)]
        assert (await http.get(PAGE, headers=two_secrets)).status_code == 401


def test_a_user_header_with_no_proof_of_the_proxy_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="CONSUMER_KIT_CONSOLE_PROXY_SECRET"):
        create_app(ConsoleConfig(settings=Settings(), app=None, token=TOKEN, user_header="X-Forwarded-User"))


async def test_a_host_the_console_does_not_serve_is_refused_token_or_not() -> None:
    """DNS rebinding: a page at evil.example resolving to 127.0.0.1 sends ``Host: evil.example``."""
    async with client() as http:
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert (await http.get(PAGE, headers=bearer)).status_code == 200
        assert (await http.get(PAGE, headers={**bearer, "Host": "evil.example:8765"})).status_code == 421
    async with client(served_names=["console.example.com"], user_header="X-Forwarded-User",
                      proxy_secret=SECRET) as http:
        proxied = {"X-Forwarded-User": "alice", "X-Console-Proxy-Secret": SECRET}
        assert (await http.get(PAGE, headers={**proxied, "Host": "console.example.com"})).status_code == 200
        assert (await http.get(PAGE, headers={**proxied, "Host": "127.0.0.1:8765"})).status_code == 421


async def test_the_token_redirect_stays_on_the_console() -> None:
    async with client() as http:
        answer = await http.get(f"/%2F%2Fevil.example/?token={TOKEN}")
        assert answer.status_code == 303
        location = answer.headers["location"]
        assert location.startswith("/") and not location.startswith("//"), location
        assert "evil.example" not in httpx.URL("http://127.0.0.1:8765").join(location).host


async def test_the_proxys_user_is_the_audited_actor_on_a_page(renv: ResilienceEnv) -> None:
    settings = Settings(database_url=renv.database_url, broker_url=renv.rabbitmq_url, db_schema=renv.schema)
    async with client(settings, address="10.1.0.9", user_header="X-Forwarded-User",
                      trusted_proxies=["10.1.0.9"], proxy_secret=SECRET) as http:
        page = await http.get("/decisions", headers={"X-Forwarded-User": "alice@corp", "X-Console-Proxy-Secret": SECRET})
        assert page.status_code == 200 and re.search(r"alice@corp", page.text)


def test_the_settings_refuse_a_trusted_proxy_that_is_no_address() -> None:
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6"):
        OperatorConsoleSettings(console_trusted_proxies=["proxy.internal"])


def test_the_cli_refuses_a_user_header_without_a_proof_of_the_proxy() -> None:
    result = CliRunner().invoke(cli, ["console", "examples.notifications.app:app", "--user-header",
                                      "X-Forwarded-User"], env={"CONSUMER_KIT_CONSOLE_PROXY_SECRET": None,
                                                                 "CONSUMER_KIT_CONSOLE_TRUSTED_PROXIES": None})
    assert result.exit_code != 0
    assert "CONSUMER_KIT_CONSOLE_TRUSTED_PROXIES" in result.output


async def test_no_page_is_kept_in_htmxs_history_cache(renv: ResilienceEnv) -> None:
    """htmx snapshots a boosted page into sessionStorage unless the document holds
    ``hx-history="false"`` (htmx docs, hx-history): then Back shows a body with no request and no
    audit. Every page (the body page included) extends base.html, whose ``<body>`` carries it."""
    settings = Settings(database_url=renv.database_url, broker_url=renv.rabbitmq_url, db_schema=renv.schema)
    async with client(settings) as http:
        page = await http.get("/decisions", headers={"Authorization": f"Bearer {TOKEN}"})
    assert page.status_code == 200
    assert re.search(r'<body\b[^>]*\bhx-history="false"', page.text)
    templates = files("consumer_kit.console_web") / "templates"
    pages = [t for t in templates.iterdir() if t.name.endswith(".html") and t.name != "base.html"]
    assert "body.html" in {t.name for t in pages}
    assert all(t.read_text().startswith('{% extends "base.html" %}') for t in pages)
