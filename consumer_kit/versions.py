"""Optimistic versions: state writes that a stale message can never roll back.

The ledger makes each *operation* take effect once; it cannot know that operation 7 ("set the
limit to 500, version 3") arriving after operation 8 ("... version 4") is stale, because 7's key is
new. Two helpers, for the two ways handlers write state:

* :func:`update_expecting` (**expected version**, compare-and-set): "change the row that is at
  version 3": it moves to version 4, or :class:`StaleVersion` is raised and the handler decides:
  ``raise PermanentFailure(...)`` to record and replay the refusal, or return a ``Result`` that
  says it was skipped.
* :func:`apply_if_newer` (**desired state with version**): "the row is this, as of version 4":
  written when newer than what is stored, ignored otherwise (``False``), so a late duplicate of an
  old event leaves newer state alone. Prefer it to relative edits (``balance = balance + x``)
  wherever events carry the aggregate's version.

Table and column names are identifiers (never formatted into SQL by hand); values are parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import AsyncConnection, sql

from consumer_kit.errors import StaleVersion


async def update_expecting(
    conn: AsyncConnection[Any],
    table: str,
    key: Mapping[str, Any],
    *,
    expected: int,
    values: Mapping[str, Any],
    version_column: str = "version",
    schema: str | None = None,
) -> int:
    """Set ``values`` on the row identified by ``key`` if it is at version ``expected``, and move
    it to ``expected + 1`` (in the caller's transaction). Returns the new version.

    Raises:
        StaleVersion: the row is at another version.
        LookupError: there is no such row.
    """
    target = _table(table, schema)
    assignments = sql.SQL(", ").join(
        [sql.SQL("{} = {}").format(sql.Identifier(c), sql.Placeholder(f"v_{c}")) for c in values]
        + [sql.SQL("{v} = {v} + 1").format(v=sql.Identifier(version_column))]
    )
    where = _key_predicate(key)
    cur = await conn.execute(
        sql.SQL("UPDATE {t} SET {a} WHERE {w} AND {v} = %(expected)s RETURNING {v}").format(
            t=target, a=assignments, w=where, v=sql.Identifier(version_column)
        ),
        {**_params("v_", values), **_params("k_", key), "expected": expected},
    )
    row = await cur.fetchone()
    if row is not None:
        return int(row[0])
    cur = await conn.execute(
        sql.SQL("SELECT {v} FROM {t} WHERE {w}").format(v=sql.Identifier(version_column), t=target, w=where),
        _params("k_", key),
    )
    found = await cur.fetchone()
    if found is None:
        raise LookupError(f"no {table} row {dict(key)!r}")
    raise StaleVersion(table, key, expected, int(found[0]))


async def apply_if_newer(
    conn: AsyncConnection[Any],
    table: str,
    key: Mapping[str, Any],
    *,
    version: int,
    values: Mapping[str, Any],
    version_column: str = "version",
    schema: str | None = None,
) -> bool:
    """Write the desired state ``values`` of the row identified by ``key`` as of ``version``:
    insert it, or update it when ``version`` is newer than the stored one. ``False`` (nothing
    written) when the stored version is the same or newer: a late or repeated event.

    The key columns need a unique constraint (the upsert's conflict target).
    """
    columns = [*key, *values, version_column]
    insert = sql.SQL("INSERT INTO {t} ({cols}) VALUES ({vals})").format(
        t=_table(table, schema),
        cols=sql.SQL(", ").join(map(sql.Identifier, columns)),
        vals=sql.SQL(", ").join(
            [sql.Placeholder(f"k_{c}") for c in key] + [sql.Placeholder(f"v_{c}") for c in values]
            + [sql.Placeholder("version")]
        ),
    )
    update = sql.SQL(", ").join(
        sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in [*values, version_column]
    )
    cur = await conn.execute(
        sql.SQL("{insert} ON CONFLICT ({keys}) DO UPDATE SET {update} WHERE {t}.{v} < EXCLUDED.{v} RETURNING 1").format(
            insert=insert, keys=sql.SQL(", ").join(map(sql.Identifier, key)), update=update,
            t=sql.Identifier(table), v=sql.Identifier(version_column),
        ),
        {**_params("k_", key), **_params("v_", values), "version": version},
    )
    return await cur.fetchone() is not None


def _table(table: str, schema: str | None) -> sql.Identifier:
    return sql.Identifier(schema, table) if schema else sql.Identifier(table)


def _key_predicate(key: Mapping[str, Any]) -> sql.Composable:
    if not key:
        raise ValueError("a versioned write needs the row's key columns")
    return sql.SQL(" AND ").join(
        sql.SQL("{} = {}").format(sql.Identifier(c), sql.Placeholder(f"k_{c}")) for c in key
    )


def _params(prefix: str, values: Mapping[str, Any]) -> dict[str, Any]:
    return {f"{prefix}{c}": v for c, v in values.items()}
