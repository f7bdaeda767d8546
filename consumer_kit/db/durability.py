"""What a commit survives, read at start (docs/scaling.md, "Failover"): the worker acks a delivery
after its commit, so the ack is only as durable as that commit.

``synchronous_commit`` and the primary's streaming standbys (``pg_stat_replication``) decide it:

* ``off``: a commit is acknowledged before it is flushed; a crash of the server may lose it;
* no standby: durable on this server's disk, lost with the server itself;
* asynchronous standbys only (``sync_state = 'async'``): a failover may lose the last commits; the
  broker messages of those were acked, and their operations are gone from the new primary;
* a synchronous standby with ``synchronous_commit`` ``on``/``remote_write``/``remote_apply``: a
  failover to it loses no acknowledged commit.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

_QUERY = (
    "SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'),"
    " count(r.*), count(r.*) FILTER (WHERE r.sync_state IN ('sync', 'quorum'))"
    " FROM (SELECT 1) AS one LEFT JOIN pg_stat_replication AS r ON true"
)


async def describe_durability(conn: AsyncConnection[Any]) -> str:
    """One line for the start log: what an acknowledged commit on ``conn``'s server survives.

    Raises:
        psycopg.Error: the server refused the query.
    """
    cur = await conn.execute(_QUERY)
    row = await cur.fetchone()
    assert row is not None
    commit, names, standbys, synchronous = row
    if commit == "off":
        return ("synchronous_commit=off: a delivery may be acked before its commit is flushed; a crash"
                " of the server can lose acked work")
    if not standbys:
        return f"synchronous_commit={commit}, no streaming standby: commits survive a restart, not the loss of the server"
    if synchronous and commit in ("on", "remote_write", "remote_apply"):
        return (f"synchronous_commit={commit}, {synchronous} synchronous standby of {standbys}"
                f" ({names}): a failover to it loses no acked commit")
    return (f"synchronous_commit={commit}, {standbys} asynchronous standby: a failover can lose the last"
            " acked commits (their messages are not redelivered); make a standby synchronous"
            " (synchronous_standby_names) to guarantee them")
