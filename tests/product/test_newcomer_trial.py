"""What a newcomer's trial (a fresh clone, the README only) ran into: a blank URL taken for a real
one, a driver's message that quoted the password, install hints for a package index consumer-kit
is not on. Commands run in-process through typer's runner (each stops before a server is needed)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from consumer_kit import App
from consumer_kit.cli.main import cli
from consumer_kit.errors import ConfigurationError, MissingExtra, install_hint
from consumer_kit.outbox_relay.cli import app as relay_app
from consumer_kit.settings import BrokerSettings, DatabaseSettings, Settings

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def invoke(app: typer.Typer, argv: list[str], cwd: Path, **env: str) -> tuple[int, str]:
    """``app argv`` in ``cwd`` with only ``env`` of the CONSUMER_KIT_* variables; (exit code, output).
    libpq's own defaults point at a closed port: a URL that reached libpq blank touches no database."""
    clean: dict[str, str | None] = {k: None for k in os.environ if k.upper().startswith(("CONSUMER_KIT_", "PG"))}
    clean |= {"PGHOST": "127.0.0.1", "PGPORT": str(closed_port())}
    old = Path.cwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, argv, env={**clean, "COLUMNS": "200", **env})
    finally:
        os.chdir(old)
    return result.exit_code, result.stdout + result.stderr


BROKER = f"amqp://guest:guest@127.0.0.1:{closed_port()}/"  # never reached: each command stops first

def commands(*rows: tuple[typer.Typer, list[str], str]) -> list[object]:
    """(app, argv, the program an error names) as parameters named for the command line."""
    return [
        pytest.param(app, argv, program, id=" ".join(["outbox-relay" if app is relay_app else "consumer-kit", *argv]))
        for app, argv, program in rows
    ]


DATABASE_COMMANDS = [
    (cli, ["migrate"], "consumer-kit migrate"),
    (cli, ["stats"], "consumer-kit stats"),
    (cli, ["ledger", "list"], "consumer-kit ledger list"),
    (cli, ["prune"], "consumer-kit prune"),
    (cli, ["worker", "consumer_kit.demo.app:app"], "consumer-kit worker"),
    (relay_app, [], "outbox-relay"),
    (relay_app, ["status"], "outbox-relay"),
]
MORE_DATABASE_COMMANDS = [
    (cli, ["ledger", "show", "default/x/v1", "k"], "consumer-kit ledger show"),
    (relay_app, ["requeue"], "outbox-relay"),
    (relay_app, ["cleanup"], "outbox-relay"),
    (relay_app, ["rebind"], "outbox-relay rebind"),
]


# -- a blank URL is an unset URL ------------------------------------------------------------------


@pytest.mark.parametrize("blank", ["", "  "])
@pytest.mark.parametrize("app, argv, program", commands(*DATABASE_COMMANDS))
def test_a_blank_database_url_is_refused_as_unset_and_nothing_is_touched(
    tmp_path: Path, app: typer.Typer, argv: list[str], program: str, blank: str
) -> None:
    """A blank URL once reached libpq as "" (its defaults: another database got the schema)."""
    code, said = invoke(app, argv, tmp_path, CONSUMER_KIT_DATABASE_URL=blank, CONSUMER_KIT_BROKER_URL=BROKER)
    assert code == 2, said
    assert said.startswith(f"error: {program} needs a database: set CONSUMER_KIT_DATABASE_URL"), said
    assert list(tmp_path.iterdir()) == []  # no embedded database was started either


def test_blank_database_url_settings_read_as_unset() -> None:
    assert DatabaseSettings(database_url="").database_url is None
    assert DatabaseSettings(database_url=" \t").database_url is None
    assert DatabaseSettings(database_url=" \t").embedded  # in-process runs (the demo): the embedded one
    assert DatabaseSettings(database_url="host=db dbname=app").database_url == "host=db dbname=app"  # a DSN


def test_the_testing_kit_takes_a_blank_test_database_url_as_unset(tmp_path: Path) -> None:
    (tmp_path / "test_url.py").write_text(
        "import os\n\n\ndef test_url(ck_database_url):\n    assert ck_database_url == os.environ['EXPECTED']\n"
    )
    url = "postgresql://u@127.0.0.1:1/x"  # never connected to: the fixture only names it
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONSUMER_KIT_")}
    env |= {"CONSUMER_KIT_TEST_DATABASE_URL": " ", "CONSUMER_KIT_DATABASE_URL": url, "EXPECTED": url}
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_url.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 0, ran.stdout + ran.stderr


@pytest.mark.parametrize("app, argv, program", commands(
    (cli, ["worker", "consumer_kit.demo.app:app"], "consumer-kit worker"),
    (cli, ["declare", "consumer_kit.demo.app:app"], "consumer-kit declare"),
    (relay_app, [], "outbox-relay"),
))
def test_a_blank_broker_url_is_refused_as_unset(tmp_path: Path, app: typer.Typer, argv: list[str], program: str) -> None:
    code, said = invoke(app, argv, tmp_path, CONSUMER_KIT_BROKER_URL=" ",
                        CONSUMER_KIT_DATABASE_URL="postgresql://u@127.0.0.1:1/x")
    assert code == 2, said
    assert said.startswith(f"error: {program} needs a real broker: set CONSUMER_KIT_BROKER_URL"), said
    assert "no broker adapter for scheme" not in said
    assert BrokerSettings(broker_url="").broker_url == "memory://"


# -- no password in an error ----------------------------------------------------------------------


def test_a_wrong_scheme_in_code_raises_without_the_password() -> None:
    with pytest.raises(ValidationError, match=r"got 'postgresql\+asyncpg'") as refused:
        Settings(database_url=f"postgresql+asyncpg://u:{SECRET}@127.0.0.1/x")
    assert SECRET not in str(refused.value)


@pytest.mark.parametrize("app, argv, program", commands(*DATABASE_COMMANDS, *MORE_DATABASE_COMMANDS))
def test_a_wrong_scheme_is_named_and_the_password_never_printed(
    tmp_path: Path, app: typer.Typer, argv: list[str], program: str
) -> None:
    code, said = invoke(app, argv, tmp_path, CONSUMER_KIT_BROKER_URL=BROKER,
                        CONSUMER_KIT_DATABASE_URL=f"postgresql+asyncpg://u:{SECRET}@127.0.0.1/x")
    assert code == 2, said
    assert said.splitlines() == [
        "error: CONSUMER_KIT_DATABASE_URL=postgresql+asyncpg://u:***@127.0.0.1/x: must start with postgresql:// "
        "or postgres:// (got 'postgresql+asyncpg') (e.g. postgresql://user:password@db.example:5432/app)"
    ]


@pytest.mark.parametrize("app, argv, program", commands(
    *DATABASE_COMMANDS, *MORE_DATABASE_COMMANDS, (relay_app, ["--once"], "outbox-relay"),
))
def test_the_driver_message_is_printed_with_the_password_masked(
    tmp_path: Path, app: typer.Typer, argv: list[str], program: str
) -> None:
    """libpq quotes a URI it cannot parse whole: its message went out with the password in it."""
    code, said = invoke(app, argv, ROOT, CONSUMER_KIT_BROKER_URL=BROKER,
                        CONSUMER_KIT_DATABASE_URL=f"postgresql://u:{SECRET}@[::1/x")
    assert code == 2, said
    assert SECRET not in said
    assert 'IPv6 host address in URI: "postgresql://u:***@[::1/x"' in said, said  # the reason, masked


async def test_the_console_page_says_the_database_failed_without_the_password() -> None:
    from consumer_kit.console_web import ConsoleConfig, create_app

    settings = Settings(database_url=f"postgresql://u:{SECRET}@[::1/x", broker_url=BROKER)
    config = ConsoleConfig(settings=settings, app=App("empty"), token="t" * 32, actor="ops@example")
    transport = httpx.ASGITransport(app=create_app(config))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.get("/decisions", headers={"Authorization": "Bearer " + "t" * 32})
    assert response.status_code == 503
    assert SECRET not in response.text and "postgresql://u:***@[::1/x" in response.text


# -- install hints for a clone ------------------------------------------------------------------------


def test_a_missing_extra_names_the_install_for_an_installed_package_and_for_a_clone() -> None:
    hint = "pip install 'consumer-kit[sqs]' (from a clone: pip install -e '.[sqs]')"
    assert install_hint("sqs") == hint
    assert MissingExtra("sqs", ImportError("No module named 'boto3'", name="boto3")).hint == hint


def test_the_embedded_database_without_pgserver_names_both_installs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from consumer_kit.db.embedded import embedded_database_url

    monkeypatch.setitem(sys.modules, "pgserver", None)  # import fails, as without the extra
    with pytest.raises(ConfigurationError, match=r"\(from a clone: pip install -e '\.\[embedded\]'\)"):
        embedded_database_url(tmp_path / "pgdata")
    assert list(tmp_path.iterdir()) == []


def test_the_pages_install_from_a_clone_never_from_the_package_index() -> None:
    """consumer-kit is not on PyPI: `pip install 'consumer-kit[...]'` alone fails for a newcomer; a
    page shows it only as the error messages say it, with the install from a clone beside it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
    for page in pages:
        text = " ".join(page.read_text().split())
        for found in re.finditer(r"pip install 'consumer-kit\[([a-z,]+)\]'", text):  # not `... @ file://`
            clone = f" (from a clone: pip install -e '.[{found.group(1)}]')"
            assert text[found.end():].startswith(clone), f"{page.relative_to(ROOT)}: {text[found.start():found.end() + 60]}"
    readme, install = (ROOT / "README.md").read_text(), (ROOT / "docs" / "how-to" / "install.md").read_text()
    for text in (readme, install):  # the demo's install works from the clone's root (tests/product/test_demo.py)
        assert "python3 -m venv .venv && .venv/bin/pip install -e '.[embedded]'" in text
