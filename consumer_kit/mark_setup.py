"""Installing the deployment's mark key (:mod:`consumer_kit.marks`) in a worker, relay or CLI."""

from __future__ import annotations

import logging
from typing import Any

from psycopg import AsyncConnection

from consumer_kit import marks
from consumer_kit.ledger.mark_keys import stored_mark_key
from consumer_kit.settings import DatabaseSettings

logger = logging.getLogger("consumer_kit.marks")


async def install_mark_keys(conn: AsyncConnection[Any], settings: DatabaseSettings) -> marks.Keyring:
    """Sign and verify marks with ``settings.mark_key`` when set, else with the key stored in the
    ledger schema; ``settings.mark_key_previous`` is accepted too. Without either, the process
    keeps its own random key (its marks are believed by itself only) and says so.

    Raises:
        ValueError: a key shorter than :data:`consumer_kit.marks.MIN_KEY_BYTES` bytes.
    """
    previous = [] if settings.mark_key_previous is None else [settings.mark_key_previous.get_secret_value().encode()]
    if settings.mark_key is not None:
        return marks.install(settings.mark_key.get_secret_value().encode(), previous, source="settings")
    stored = await stored_mark_key(conn, settings.db_schema)
    if stored is None:
        logger.warning(
            "no mark key in schema %s (run `consumer-kit migrate`): marks are signed with this process's "
            "own key, so other processes ignore them", settings.db_schema,
        )
        return marks.installed()
    return marks.install(stored, previous, source="ledger")
