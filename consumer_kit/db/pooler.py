"""Working through a transaction-mode pooler (PgBouncer ``pool_mode = transaction``, RDS Proxy,
Supavisor): each transaction may run on another server connection, so nothing may outlive one.

With ``database_pooler = "transaction"`` (docs/scaling.md):

* no ``options`` startup parameter (PgBouncer refuses it by default): the session settings of
  :func:`consumer_kit.db.pool.connection_options` are set in every transaction the runtime opens,
  with ``set_config(name, value, true)`` (``SET LOCAL``), sent with BEGIN in the same round trip;
* no prepared statements: neither SQL ``PREPARE`` (the claim is sent as text) nor psycopg's
  protocol-level ones (``prepare_threshold=None``), which a pooler without prepared-statement
  support sends to whichever server it picks.

A connection opened for this mode is registered here with its transaction prelude; one that is not
(a direct connection) keeps the session options and the prepared claim.
"""

from __future__ import annotations

import weakref
from typing import Any

from psycopg import AsyncConnection

TRANSACTION = "transaction"

# Connection -> the statement that opens each of its transactions (BEGIN and the SET LOCALs).
_BEGIN_ON: weakref.WeakKeyDictionary[AsyncConnection[Any], bytes] = weakref.WeakKeyDictionary()


def in_transaction_mode(settings: Any) -> bool:
    """True when ``settings.database_pooler`` says a transaction-mode pooler is in front."""
    return getattr(settings, "database_pooler", "none") == TRANSACTION


def connect_options(settings: Any) -> dict[str, Any]:
    """Keyword arguments every psycopg connection of ``settings`` adds (CLIs, console, relay):
    ``prepare_threshold=None`` behind a transaction-mode pooler, else nothing."""
    return {"prepare_threshold": None} if in_transaction_mode(settings) else {}


def _literal(value: str) -> bytes:
    return b"'" + value.replace("'", "''").encode() + b"'"


def begin_with(local: dict[str, str]) -> bytes:
    """``BEGIN; SELECT set_config(name, value, true), ...``: one simple query that opens a
    transaction with ``local`` (setting name -> value) in force until it ends."""
    if not local:
        return b"BEGIN"
    calls = b", ".join(b"set_config(%s, %s, true)" % (_literal(k), _literal(v)) for k, v in local.items())
    return b"BEGIN; SELECT " + calls


def register(conn: AsyncConnection[Any], begin: bytes) -> None:
    """``conn`` is behind a transaction-mode pooler: its transactions open with ``begin``."""
    _BEGIN_ON[conn] = begin


def begin_statement(conn: AsyncConnection[Any]) -> bytes | None:
    """What opens a transaction on ``conn`` behind a transaction-mode pooler; ``None`` when it is a
    direct connection (the session options are already in force)."""
    return _BEGIN_ON.get(conn)
