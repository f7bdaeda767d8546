"""The deployment's mark key: made once by ``migrate`` in the ledger schema, shared by
every process of the deployment, overridable by settings, rotated with a previous key."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from consumer_kit.codec import headers as own
from consumer_kit.codec import marks
from consumer_kit.ledger import migrate
from consumer_kit.ledger.mark_keys import install_mark_keys, stored_mark_key
from consumer_kit.settings import DatabaseSettings, Settings
from tests.fixtures.harness import throwaway_schema

pytestmark = [pytest.mark.postgres]


@pytest.fixture(autouse=True)
def _keep_keyring() -> Iterator[None]:
    before = marks.installed()
    yield
    marks.install(before.current, before.previous, source=before.source)


async def test_migrate_makes_one_random_key_per_schema_and_keeps_it(database_url: str) -> None:
    async with throwaway_schema(database_url) as first, throwaway_schema(database_url) as second:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            key = await stored_mark_key(conn, first)
            assert key is not None and len(key) == 32
            assert await migrate(conn, first) == []  # a re-run keeps the key
            assert await stored_mark_key(conn, first) == key
            assert await stored_mark_key(conn, second) not in (None, key)
            assert await stored_mark_key(conn, "ck_no_such_schema") is None


async def test_two_processes_of_one_deployment_verify_each_other_s_marks(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema:
        settings = DatabaseSettings(database_url=database_url, db_schema=schema)
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            ring = await install_mark_keys(conn, settings)
            assert ring.source == "ledger" and ring.current == await stored_mark_key(conn, schema)
            signed = own.seal({own.DELIVERIES: 4}, b"{}")
            marks.install(b"x" * 32, source="another process before it read the key")
            assert own.read(signed, b"{}").deliveries_before == 0
            await install_mark_keys(conn, settings)  # the other process, started
            assert own.read(signed, b"{}").deliveries_before == 4


async def test_a_configured_key_wins_and_the_previous_one_is_accepted(database_url: str) -> None:
    async with throwaway_schema(database_url) as schema:
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            old = Settings(database_url=database_url, db_schema=schema, mark_key="o" * 20)
            await install_mark_keys(conn, old)
            signed = own.seal({own.REDELIVERED: 1}, b"{}")
            rotated = Settings(database_url=database_url, db_schema=schema, mark_key="n" * 20,
                               mark_key_previous="o" * 20)
            ring = await install_mark_keys(conn, rotated)
            assert ring.source == "settings" and ring.current == b"n" * 20
            assert own.read(signed, b"{}").suspect is True


def test_a_short_configured_key_is_refused_without_showing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from consumer_kit.errors import ConfigurationError

    monkeypatch.setenv("CONSUMER_KIT_MARK_KEY", "tooshort-secret")
    with pytest.raises(ConfigurationError) as refused:
        DatabaseSettings.from_environment()
    assert "CONSUMER_KIT_MARK_KEY" in str(refused.value) and "tooshort-secret" not in str(refused.value)
