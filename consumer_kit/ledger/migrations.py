"""The ledger's schema: ordered migrations of the ``operations`` and ``attempts`` tables and their
companions (evidence, mark keys, audit, outcome counts; the outbox's own come from
:mod:`consumer_kit.outbox`), applied by :func:`migrate`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from psycopg import AsyncConnection, sql

from consumer_kit.errors import ConfigurationError
from consumer_kit.ledger.outbox_schema import OUTBOX_MIGRATIONS
from consumer_kit.outbox import notify_channel

# Ordered, append-only; each statement is idempotent so a re-run (or a concurrent run, serialised by
# the advisory lock in ``migrate``) is safe.
LEDGER_MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE IF NOT EXISTS {schema}.operations (
            scope               text        NOT NULL,
            key                 text        NOT NULL,
            tenant              text        NOT NULL,
            operation_type      text        NOT NULL,
            fingerprint         text        NOT NULL,
            projection_version  integer     NOT NULL,
            state               text        NOT NULL CHECK (state IN
                                    ('processing', 'completed', 'failed', 'needs_reconciliation')),
            attempts            integer     NOT NULL DEFAULT 1,
            lease_owner         text,
            lease_expires_at    timestamptz,
            message_id          text,
            result_status       text,
            result_reference    text,
            result_body         jsonb,
            error_class         text,
            error_detail        text,
            created_at          timestamptz NOT NULL DEFAULT now(),
            updated_at          timestamptz NOT NULL DEFAULT now(),
            completed_at        timestamptz,
            PRIMARY KEY (scope, key)
        ) {partitioning};
        CREATE INDEX IF NOT EXISTS operations_open_leases_idx
            ON {schema}.operations (lease_expires_at) WHERE state = 'processing';
        CREATE INDEX IF NOT EXISTS operations_needs_reconciliation_idx
            ON {schema}.operations (updated_at) WHERE state = 'needs_reconciliation';
        """,
    ),
    (
        2,
        # consumer-kit's own attempt count per operation (docs/explanation/faults-and-attempts.md): it, not
        # the broker's delivery count, decides dead-lettering. Written only when something went
        # wrong (a handler fault, contention) or a redelivered message runs alone, so the common
        # path never touches it. ``running_*`` marks a run alone in progress, renewed while it runs:
        # found expired by the next run, it means the process died running this operation alone.
        """
        CREATE TABLE IF NOT EXISTS {schema}.attempts (
            scope          text        NOT NULL,
            key            text        NOT NULL,
            failures       integer     NOT NULL DEFAULT 0,
            contentions    integer     NOT NULL DEFAULT 0,
            crashes        integer     NOT NULL DEFAULT 0,
            running_owner  text,
            running_since  timestamptz,
            running_until  timestamptz,
            history        jsonb       NOT NULL DEFAULT '[]'::jsonb,
            created_at     timestamptz NOT NULL DEFAULT now(),
            updated_at     timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (scope, key)
        );
        """,
    ),
    (
        3,
        # External effects (the leased path): what a handler recorded about its remote calls, so a
        # worker that finds the operation's lease expired can reconcile instead of calling again
        # blindly; and who resolved an operation by hand (`consumer-kit ledger resolve`), when, why.
        """
        CREATE TABLE IF NOT EXISTS {schema}.evidence (
            id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            scope        text        NOT NULL,
            key          text        NOT NULL,
            name         text        NOT NULL,
            attempt      integer     NOT NULL,
            worker       text        NOT NULL,
            facts        jsonb       NOT NULL,
            recorded_at  timestamptz NOT NULL DEFAULT now()
        );
        CREATE INDEX IF NOT EXISTS evidence_operation_idx ON {schema}.evidence (scope, key, id);
        ALTER TABLE {schema}.operations
            ADD COLUMN IF NOT EXISTS resolved_by     text,
            ADD COLUMN IF NOT EXISTS resolved_at     timestamptz,
            ADD COLUMN IF NOT EXISTS resolution_note text;
        """,
    ),
    (
        4,
        # Retention (`consumer-kit prune`): when the bulky result body and the compact identity of
        # an operation may be deleted, set when the operation is first written (from its handler's
        # result_retention / key_retention; NULL: kept). Set once and never updated by the runtime,
        # so the indexes cost the completion nothing (it stays a HOT update).
        """
        ALTER TABLE {schema}.operations
            ADD COLUMN IF NOT EXISTS body_expires_at timestamptz,
            ADD COLUMN IF NOT EXISTS key_expires_at  timestamptz;
        CREATE INDEX IF NOT EXISTS operations_body_expiry_idx
            ON {schema}.operations (body_expires_at) WHERE body_expires_at IS NOT NULL;
        CREATE INDEX IF NOT EXISTS operations_key_expiry_idx
            ON {schema}.operations (key_expires_at) WHERE key_expires_at IS NOT NULL;
        """,
    ),
    (
        5,
        # The completion must be a HOT update (no index entry written, no index to bloat): no
        # index may cover a column it changes, and a partial index's predicate counts. So the two
        # indexes on state went, and the rows an operator may need to look at carry
        # ``watch_since`` instead: set by a committed leased claim and by parking, cleared when
        # such a row ends; the transactional path never sets it (its claim is not visible until
        # its completion commits), so its completion leaves it NULL and stays HOT.
        """
        ALTER TABLE {schema}.operations ADD COLUMN IF NOT EXISTS watch_since timestamptz;
        UPDATE {schema}.operations SET watch_since = updated_at
         WHERE state IN ('processing', 'needs_reconciliation') AND watch_since IS NULL;
        CREATE INDEX IF NOT EXISTS operations_watch_idx
            ON {schema}.operations (watch_since) WHERE watch_since IS NOT NULL;
        DROP INDEX IF EXISTS {schema}.operations_open_leases_idx;
        DROP INDEX IF EXISTS {schema}.operations_needs_reconciliation_idx;
        -- and room in the page for the completed version: inserts leave 10% of each page free
        -- (on each partition of a partitioned ledger; the parent takes no storage parameters)
        DO $ff$
        DECLARE part regclass;
        BEGIN
            FOR part IN SELECT c.oid::regclass FROM pg_class AS c
                         WHERE c.relnamespace = '{schema}'::regnamespace AND c.relkind = 'r'
                           AND (c.relname = 'operations' OR c.relname ~ '^operations_p[0-9]+$')
            LOOP
                EXECUTE format('ALTER TABLE %s SET (fillfactor = 90)', part);
            END LOOP;
        END
        $ff$;
        """,
    ),
    (
        6,
        # The key that signs consumer-kit's marks on the copies it sends (consumer_kit.codec.marks): made
        # here at random (gen_random_uuid draws from the server's strong random source: 2 x 122
        # bits), so every worker, relay and CLI sharing this database shares it and producers,
        # who have no access to it, cannot forge a mark. One row; a deployment may set its own.
        """
        CREATE TABLE IF NOT EXISTS {schema}.mark_keys (
            id          smallint    PRIMARY KEY CHECK (id = 1),
            secret      bytea       NOT NULL,
            created_at  timestamptz NOT NULL DEFAULT now()
        );
        INSERT INTO {schema}.mark_keys (id, secret)
        VALUES (1, decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'))
        ON CONFLICT (id) DO NOTHING;
        """,
    ),
    (
        7,
        # The operator's console (`consumer-kit console`): every action taken there (a resolution,
        # a redrive or its dry run, a body shown, a refusal) and by `consumer-kit ledger resolve`,
        # with who, when, what and why. Append-only; read newest first.
        """
        CREATE TABLE IF NOT EXISTS {schema}.audit (
            id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            at       timestamptz NOT NULL DEFAULT now(),
            actor    text        NOT NULL,
            source   text        NOT NULL,
            action   text        NOT NULL,
            target   text        NOT NULL,
            outcome  text        NOT NULL,
            note     text        NOT NULL DEFAULT '',
            details  jsonb       NOT NULL DEFAULT '{{}}'::jsonb
        );
        CREATE INDEX IF NOT EXISTS audit_at_idx ON {schema}.audit (at);
        """,
    ),
    (
        8,
        # Outcome counts per operation type and minute (consumer_kit.ledger.outcome_counts): the
        # durable trace of what leaves no row of its own (duplicates, payload conflicts,
        # in-progress collisions, key-expiry refusals). Written off the hot path: each worker adds
        # its in-memory counts in one statement per summary interval; pruned by `consumer-kit prune`.
        """
        CREATE TABLE IF NOT EXISTS {schema}.outcome_counts (
            operation_type  text        NOT NULL,
            outcome         text        NOT NULL,
            minute          timestamptz NOT NULL,
            count           bigint      NOT NULL CHECK (count >= 0),
            PRIMARY KEY (operation_type, outcome, minute)
        );
        CREATE INDEX IF NOT EXISTS outcome_counts_minute_idx ON {schema}.outcome_counts (minute);
        """,
    ),
    (
        9,
        # The audit is append-only (docs/how-to/console.md, "Audit"): an UPDATE, DELETE or
        # TRUNCATE of its rows by the application's role is refused. Only the table's owner, by
        # dropping the trigger, can change history; run migrations as a role the workers do not use.
        """
        CREATE OR REPLACE FUNCTION {schema}.audit_append_only() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'the audit is append-only: % refused', TG_OP
                USING ERRCODE = 'insufficient_privilege';
        END
        $$;
        DROP TRIGGER IF EXISTS audit_append_only ON {schema}.audit;
        CREATE TRIGGER audit_append_only BEFORE UPDATE OR DELETE ON {schema}.audit
            FOR EACH ROW EXECUTE FUNCTION {schema}.audit_append_only();
        DROP TRIGGER IF EXISTS audit_no_truncate ON {schema}.audit;
        CREATE TRIGGER audit_no_truncate BEFORE TRUNCATE ON {schema}.audit
            FOR EACH STATEMENT EXECUTE FUNCTION {schema}.audit_append_only();
        """,
    ),
]


async def migrate(conn: AsyncConnection[Any], schema: str, *, partitions: int | None = None) -> list[int]:
    """Create or upgrade the ledger and outbox in ``schema``; safe to re-run and to run concurrently.

    Args:
        partitions: create the ``operations`` table hash-partitioned on (scope, key) into this
            many partitions (2-1024). Only when the ledger does not exist yet: an existing one is
            never repartitioned here (a maintenance step of its own, see docs/scaling.md).

    Returns the migration versions applied by this call (empty when already up to date).

    Raises:
        ConfigurationError: ``partitions`` out of range, or asked for on an existing ledger that
            is not partitioned that way.
    """
    if partitions is not None and not 2 <= partitions <= 1024:
        raise ConfigurationError(f"--partitions={partitions}: must be between 2 and 1024 (e.g. 16)")
    schema_id = sql.Identifier(schema)
    applied_now: list[int] = []
    partitioning = sql.SQL("PARTITION BY HASH (scope, key)" if partitions else "")
    async with conn.transaction():
        # Serialise concurrent migrators (two workers starting at once) on one schema.
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", ("consumer_kit:" + schema,))
        await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema_id))
        await conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (version integer PRIMARY KEY, "
                "applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(sql.Identifier(schema, "schema_migrations"))
        )
        cur = await conn.execute(
            sql.SQL("SELECT version FROM {}").format(sql.Identifier(schema, "schema_migrations"))
        )
        done = {row[0] for row in await cur.fetchall()}
        if partitions and 1 in done and await ledger_partitions(conn, schema) != partitions:
            raise ConfigurationError(
                f"schema {schema!r} already has a ledger that is not hash-partitioned into {partitions}: "
                "repartitioning a ledger in use is a maintenance step of its own (docs/scaling.md)"
            )
        for version, ddl in sorted(LEDGER_MIGRATIONS + OUTBOX_MIGRATIONS):
            if version in done:
                continue
            await conn.execute(
                sql.SQL(ddl).format(
                    schema=schema_id, channel=sql.Literal(notify_channel(schema)), partitioning=partitioning
                )
            )
            if version == 1 and partitions:
                for remainder in range(partitions):
                    await conn.execute(
                        sql.SQL(
                            "CREATE TABLE IF NOT EXISTS {part} PARTITION OF {table} "
                            "FOR VALUES WITH (MODULUS {modulus}, REMAINDER {remainder})"
                        ).format(
                            part=sql.Identifier(schema, f"operations_p{remainder}"),
                            table=sql.Identifier(schema, "operations"),
                            modulus=sql.Literal(partitions), remainder=sql.Literal(remainder),
                        )
                    )
            await conn.execute(
                sql.SQL("INSERT INTO {} (version) VALUES (%s)").format(
                    sql.Identifier(schema, "schema_migrations")
                ),
                (version,),
            )
            applied_now.append(version)
    return applied_now


async def ledger_partitions(conn: AsyncConnection[Any], schema: str) -> int | None:
    """How many hash partitions ``schema``'s ``operations`` table has (``None``: not partitioned)."""
    return len(await partition_names(conn, schema)) or None


async def partition_names(conn: AsyncConnection[Any], schema: str) -> list[str]:
    """The partitions of ``schema``'s ``operations`` table (``[]``: not partitioned)."""
    cur = await conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
        "WHERE i.inhparent = to_regclass(%s) ORDER BY c.relname",
        (sql.Identifier(schema, "operations").as_string(conn),),
    )
    return [str(row[0]) for row in await cur.fetchall()]


async def schema_ready(conn: AsyncConnection[Any], schema: str) -> bool:
    """``True`` when ``schema`` holds the ledger with every migration applied."""
    return not await missing_migrations(conn, schema)


async def missing_migrations(conn: AsyncConnection[Any], schema: str) -> list[int]:
    """The migration versions ``consumer-kit migrate`` would still apply to ``schema`` (all of them
    when the schema has no ledger)."""
    wanted = sorted(version for version, _ in LEDGER_MIGRATIONS + OUTBOX_MIGRATIONS)
    cur = await conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL",
        (sql.Identifier(schema, "schema_migrations").as_string(conn),),
    )
    row = await cur.fetchone()
    if not (row and row[0]):
        return wanted
    cur = await conn.execute(
        sql.SQL("SELECT version FROM {}").format(sql.Identifier(schema, "schema_migrations"))
    )
    done = {r[0] for r in await cur.fetchall()}
    return [v for v in wanted if v not in done]


async def run_startup_hooks(
    conn: AsyncConnection[Any], schema: str,
    hooks: Sequence[Callable[[AsyncConnection[Any]], Awaitable[None]]],
) -> None:
    """Run ``hooks`` (``App.on_startup``) in one transaction holding the schema's start-up advisory
    lock (transaction-scoped, so it works through a transaction-mode pooler): workers started
    together run them one after another, so two ``CREATE TABLE IF NOT EXISTS`` never race. A hook
    runs inside that transaction (``conn.transaction()`` in it is a savepoint).

    Raises:
        Exception: what a hook raises (the transaction rolls back).
    """
    if not hooks:
        return
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", ("consumer_kit:startup:" + schema,))
        for hook in hooks:
            await hook(conn)
