"""The relay's statements on ``<schema>.outbox`` as ``psycopg.sql`` templates (``{table}`` is the
outbox's identifier), formatted once per schema by :class:`consumer_kit.outbox_relay.store.OutboxStore`.

Why the claim is written the way it is (index-order probes, never a sort) is said beside it.
"""

from __future__ import annotations

from psycopg import sql

# The claim's plan must not depend on statistics: an outbox is a queue table, its statistics are
# stale more often than not, and a plan that scans every pending row (a bitmap scan and a sort, a
# hash anti-join) makes each claim cost the whole backlog, so a drain slows quadratically. So
# every step here is a one-row ``ORDER BY <indexed column> LIMIT 1`` probe of a partial index
# (a loose index scan, written as a recursive CTE), a plan no row estimate makes dearer:
#
# * keys (ordered only): the next ``keys`` partition keys after a rotating key cursor
#   (``outbox_pending_commit_seq_idx``), and each key's head, its smallest ``commit_seq``;
# * ids: the next ``window`` due rows in (available_at, id) order after a rotating cursor;
#   ordered, the unkeyed ones (``outbox_due_unkeyed_idx``), unordered, all
#   (``outbox_pending_idx``). Rows backing off are not due and a parked row is due at
#   'infinity', so failing rows are not visited at all.
#
# Of those candidates the claimable ones (not leased, not parked) are locked and leased, oldest
# id first. A claim costs O((keys + window) log n) whatever the backlog, and the cursors start
# over at the end, so every key and due row comes round: rows in front that cannot be claimed
# (leased by another relay, a key whose head backs off) cannot starve the ones behind them.
# Statistics alone cannot be trusted here: analysed while almost nothing was pending (a quiet
# hour, or a long published history), they say ``published_at IS NULL`` matches a row or two, so
# reading a whole pending index and sorting it looks cheaper than walking an index in order, and
# each one-row probe below costs the whole backlog (measured: one claim of 200 took 4.1 s at 10k
# pending and 22.5 s at 50k; 15-54 ms with this setting). Without sorts the only plans left for
# an ``ORDER BY ... LIMIT 1`` probe walk an index in its order; JIT goes too, as the disabled
# sort's cost estimate would otherwise make every claim compile.
PLAN_BY_INDEX_ORDER = (b"SET LOCAL enable_sort = off", b"SET LOCAL jit = off")

KEYS = """
    keys(partition_key, n) AS (
        SELECT (SELECT e.partition_key FROM {table} AS e
                 WHERE e.published_at IS NULL AND e.partition_key {first_key} %(after_key)s
                 ORDER BY e.partition_key LIMIT 1), 1
        UNION ALL
        SELECT (SELECT e.partition_key FROM {table} AS e
                 WHERE e.published_at IS NULL AND e.partition_key > keys.partition_key
                 ORDER BY e.partition_key LIMIT 1), keys.n + 1
          FROM keys WHERE keys.partition_key IS NOT NULL AND keys.n < %(keys)s
    ),
    heads AS (
        SELECT head.id FROM keys CROSS JOIN LATERAL (
            SELECT e.id FROM {table} AS e
             WHERE e.partition_key = keys.partition_key AND e.published_at IS NULL
             ORDER BY e.commit_seq LIMIT 1) AS head
    ),
    key_cursor AS (
        SELECT max(partition_key) AS last, count(partition_key) >= %(keys)s AS more FROM keys
    ),"""

NO_KEYS = """
    heads AS (SELECT NULL::bigint AS id WHERE false),
    key_cursor AS (SELECT NULL::text AS last, false AS more),"""

IDS = """
    ids(available_at, id, n) AS (
        SELECT first.available_at, first.id, 1 FROM (
            SELECT e.available_at, e.id FROM {table} AS e
             WHERE e.published_at IS NULL {unkeyed} AND e.available_at <= now()
               AND (e.available_at, e.id) > (%(after_at)s, %(after_id)s)
             ORDER BY e.available_at, e.id LIMIT 1) AS first
        UNION ALL
        SELECT next.available_at, next.id, ids.n + 1 FROM ids CROSS JOIN LATERAL (
            SELECT e.available_at, e.id FROM {table} AS e
             WHERE e.published_at IS NULL {unkeyed} AND e.available_at <= now()
               AND (e.available_at, e.id) > (ids.available_at, ids.id)
             ORDER BY e.available_at, e.id LIMIT 1) AS next
         WHERE ids.n < %(window)s
    ),
    id_cursor AS (
        SELECT max(available_at) AS last_at, max(id) FILTER (WHERE n = %(window)s) AS last_id,
               count(*) >= %(window)s AS more FROM ids
    ),
    candidates AS (SELECT id FROM heads UNION ALL SELECT id FROM ids)"""

ORDERED = KEYS + IDS.replace("{unkeyed}", "AND e.partition_key IS NULL")
# From the start of the keys, '' included (a key cursor of '' would skip the key '').
CANDIDATES_ORDERED_FROM_START = sql.SQL(ORDERED.replace("{first_key}", ">="))
CANDIDATES_ORDERED = sql.SQL(ORDERED.replace("{first_key}", ">"))
CANDIDATES_UNORDERED = sql.SQL(NO_KEYS + IDS.replace("{unkeyed}", ""))

CLAIM = sql.SQL(
    """
    WITH RECURSIVE {candidates},
    picked AS (
        -- one primary-key probe per candidate, oldest first, until ``limit`` are locked: a
        -- join would let stale statistics pick a scan of a whole pending index instead
        SELECT row.id, row.previous_owner
          FROM (SELECT DISTINCT id FROM candidates ORDER BY id) AS c
          CROSS JOIN LATERAL (
              SELECT o.id, o.claimed_by AS previous_owner
                FROM {table} AS o
               WHERE o.id = c.id
                 AND coalesce(o.published_at, '-infinity') = '-infinity'  -- see _BY_ID
                 AND o.attempts < %(max_attempts)s
                 AND o.available_at <= now()
                 AND (o.claimed_until IS NULL OR o.claimed_until < now())
                 FOR UPDATE OF o SKIP LOCKED) AS row
         LIMIT %(limit)s
    ),
    claimed AS (
        UPDATE {table} AS t
           SET claimed_by = %(relay_id)s,
               claimed_until = now() + make_interval(secs => %(lease)s)
          FROM picked
         WHERE t.id = picked.id
        RETURNING t.id, t.event_id, t.destination, t.routing_key, t.message_type, t.partition_key,
                  t.payload::text, t.headers, t.attempts, t.operation_scope, t.operation_key,
                  t.correlation_id, t.created_at, picked.previous_owner
    )
    SELECT claimed.*, key_cursor.last, key_cursor.more,
           id_cursor.last_at, id_cursor.last_id, id_cursor.more
      FROM key_cursor CROSS JOIN id_cursor LEFT JOIN claimed ON true
    """
)

# _BY_ID: statements that address rows by id say "unpublished" as
# ``coalesce(published_at, '-infinity') = '-infinity'``, which no partial index's predicate
# matches: with ``published_at IS NULL``, stale statistics (see PLAN_BY_INDEX_ORDER) let the
# planner read a whole pending index instead of probing the primary key (measured by the drain
# benchmark: mark_published p50 49-68 ms at 100k pending, 2-4 ms this way).
MARK_PUBLISHED = sql.SQL(
    """
    UPDATE {table}
       SET published_at = now(), attempts = attempts + 1,
           claimed_by = %(relay_id)s, claimed_until = NULL
     WHERE id = ANY(%(ids)s) AND coalesce(published_at, '-infinity') = '-infinity'  -- see _BY_ID
    """
)

MARK_FAILED = sql.SQL(
    """
    UPDATE {table} AS t
       SET attempts = CASE WHEN f.park THEN greatest(t.attempts + 1, %(max_attempts)s)
                           WHEN f.transient THEN least(t.attempts + 1, %(max_attempts)s - 1)
                           ELSE t.attempts + 1 END,
           last_error = f.error,
           -- a parked row is due never (until requeued), so the claim's windows skip it
           available_at = CASE
               WHEN f.park OR (NOT f.transient AND t.attempts + 1 >= %(max_attempts)s)
               THEN 'infinity'::timestamptz
               ELSE now() + make_interval(
                   secs => least(CASE WHEN f.transient THEN %(transient_max_delay)s
                                      ELSE %(max_delay)s END,
                                 %(base)s * power(2, least(t.attempts, 30)))) END,
           claimed_by = NULL,
           claimed_until = NULL
      FROM unnest(%(ids)s::bigint[], %(errors)s::text[], %(park)s::boolean[],
                  %(transient)s::boolean[]) AS f(id, error, park, transient)
     WHERE t.id = f.id AND coalesce(t.published_at, '-infinity') = '-infinity'  -- see _BY_ID
       AND t.claimed_by = %(relay_id)s
    RETURNING t.id, t.attempts >= %(max_attempts)s
    """
)

RELEASE = sql.SQL(
    """
    UPDATE {table} SET claimed_by = NULL, claimed_until = NULL
     WHERE id = ANY(%(ids)s) AND coalesce(published_at, '-infinity') = '-infinity'  -- see _BY_ID
       AND claimed_by = %(relay_id)s
    """
)

CLEANUP = sql.SQL(
    """
    DELETE FROM {table}
     WHERE id IN (
        SELECT id FROM {table}
         WHERE published_at < now() - make_interval(secs => %(older_than)s)
         ORDER BY published_at
         LIMIT %(limit)s
         FOR UPDATE SKIP LOCKED)
    """
)

# A row is parked when it has max_attempts failed attempts, or when it was parked (due at
# 'infinity') under a smaller max_attempts: raising RELAY_MAX_ATTEMPTS, or a status or requeue run
# without the relay's value, must not turn parked rows into pending ones no claim can reach.
PARKED_ROW = sql.SQL("(attempts >= %(max_attempts)s OR available_at = 'infinity')")

STATUS = sql.SQL(
    """
    SELECT count(*) FILTER (WHERE published_at IS NULL AND NOT {parked}),
           count(*) FILTER (WHERE published_at IS NULL AND attempts >= 1 AND NOT {parked}),
           count(*) FILTER (WHERE published_at IS NULL AND claimed_until > now()),
           count(*) FILTER (WHERE published_at IS NULL AND {parked}),
           extract(epoch FROM now() - min(created_at)
                   FILTER (WHERE published_at IS NULL AND NOT {parked})),
           count(*) FILTER (WHERE published_at >= now() - interval '1 minute'),
           count(*) FILTER (WHERE published_at IS NOT NULL)
      FROM {table}
    """
)

PARKED = sql.SQL(
    """
    SELECT event_id, destination, partition_key, attempts, last_error, created_at
      FROM {table}
     WHERE published_at IS NULL AND {parked}
     ORDER BY id
     LIMIT %(limit)s
    """
)

REQUEUE = sql.SQL(
    """
    UPDATE {table} SET attempts = 0, available_at = now(), claimed_by = NULL, claimed_until = NULL
     WHERE published_at IS NULL AND {parked}
       AND (%(all)s OR event_id = ANY(%(event_ids)s::uuid[]))
    """
)

# Parked rows are left out: a row parked for an unknown destination must not keep the relay from
# starting (and every other row from being published).
PENDING_DESTINATIONS = sql.SQL(
    "SELECT DISTINCT destination FROM {table} WHERE published_at IS NULL AND NOT {parked}"
)

MIGRATION_APPLIED = sql.SQL("SELECT version FROM {table} WHERE version = %s")
"""Whether a migration is recorded (``{table}``: the schema's ``schema_migrations``)."""
