"""The ``outbox`` table's migrations (versions 101 and up), run with the ledger's by
:func:`consumer_kit.ledger.migrations.migrate`; the statements that write and read it are
:mod:`consumer_kit.outbox`'s and the relay's."""

from __future__ import annotations

OUTBOX_MIGRATIONS: list[tuple[int, str]] = [
    (
        101,
        """
        CREATE TABLE IF NOT EXISTS {schema}.outbox (
            id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            event_id         uuid        NOT NULL UNIQUE,
            destination      text        NOT NULL,
            routing_key      text        NOT NULL DEFAULT '',
            message_type     text        NOT NULL,
            partition_key    text,
            payload          jsonb       NOT NULL,
            headers          jsonb       NOT NULL DEFAULT '{{}}'::jsonb,
            created_at       timestamptz NOT NULL DEFAULT now(),
            available_at     timestamptz NOT NULL DEFAULT now(),
            published_at     timestamptz,
            attempts         integer     NOT NULL DEFAULT 0,
            last_error       text,
            claimed_by       text,
            claimed_until    timestamptz,
            operation_scope  text,
            operation_key    text,
            correlation_id   text
        );
        CREATE INDEX IF NOT EXISTS outbox_pending_idx
            ON {schema}.outbox (available_at, id) WHERE published_at IS NULL;
        CREATE INDEX IF NOT EXISTS outbox_pending_partition_idx
            ON {schema}.outbox (partition_key, id)
            WHERE published_at IS NULL AND partition_key IS NOT NULL;
        CREATE INDEX IF NOT EXISTS outbox_published_at_idx
            ON {schema}.outbox (published_at) WHERE published_at IS NOT NULL;
        CREATE OR REPLACE FUNCTION {schema}.outbox_notify() RETURNS trigger
            LANGUAGE plpgsql AS $fn$
            BEGIN
                -- identical notifications in one transaction are folded by PostgreSQL: one per commit
                PERFORM pg_notify({channel}, '');
                RETURN NULL;
            END
            $fn$;
        DROP TRIGGER IF EXISTS outbox_notify ON {schema}.outbox;
        CREATE TRIGGER outbox_notify AFTER INSERT ON {schema}.outbox
            FOR EACH STATEMENT EXECUTE FUNCTION {schema}.outbox_notify();
        """,
    ),
    (
        102,
        # Commit order per partition key (used by outbox_relay; see its package docstring).
        # A BEFORE INSERT trigger takes a transaction-scoped advisory lock on (schema, partition
        # key) and only then draws commit_seq from a sequence: two transactions writing the same
        # key are serialised from that insert to their COMMIT, so commit_seq order is their
        # commit order (the identity id is drawn before the trigger and is not). Rows without
        # a partition key take no lock and get no commit_seq.
        """
        ALTER TABLE {schema}.outbox ADD COLUMN IF NOT EXISTS commit_seq bigint;
        CREATE SEQUENCE IF NOT EXISTS {schema}.outbox_commit_seq;
        CREATE INDEX IF NOT EXISTS outbox_pending_commit_seq_idx
            ON {schema}.outbox (partition_key, commit_seq)
            WHERE published_at IS NULL AND partition_key IS NOT NULL;
        CREATE INDEX IF NOT EXISTS outbox_unpublished_id_idx
            ON {schema}.outbox (id) WHERE published_at IS NULL;
        CREATE OR REPLACE FUNCTION {schema}.outbox_commit_order() RETURNS trigger
            LANGUAGE plpgsql AS $fn$
            BEGIN
                IF NEW.partition_key IS NOT NULL THEN
                    PERFORM pg_advisory_xact_lock(
                        hashtext(TG_TABLE_SCHEMA || '.outbox'), hashtext(NEW.partition_key));
                    NEW.commit_seq := nextval(
                        format('%I.outbox_commit_seq', TG_TABLE_SCHEMA)::regclass);
                END IF;
                RETURN NEW;
            END
            $fn$;
        DROP TRIGGER IF EXISTS outbox_commit_order ON {schema}.outbox;
        CREATE TRIGGER outbox_commit_order BEFORE INSERT ON {schema}.outbox
            FOR EACH ROW EXECUTE FUNCTION {schema}.outbox_commit_order();
        UPDATE {schema}.outbox AS o SET commit_seq = s.seq
            FROM (SELECT id, nextval('{schema}.outbox_commit_seq'::regclass) AS seq
                  FROM (SELECT id FROM {schema}.outbox
                        WHERE partition_key IS NOT NULL AND commit_seq IS NULL
                        ORDER BY id) AS pending) AS s
            WHERE o.id = s.id;
        """,
    ),
    (
        103,
        # NOTIFY can be switched off per session (``-c consumer_kit.outbox_notify=off``, set by the
        # worker's pool when CONSUMER_KIT_OUTBOX_NOTIFY=false): PostgreSQL serialises the commits
        # of transactions that issued NOTIFY, which caps fleets of writers (pgbench: 1.3x with 8
        # clients without it). The relay then finds rows by polling alone.
        """
        CREATE OR REPLACE FUNCTION {schema}.outbox_notify() RETURNS trigger
            LANGUAGE plpgsql AS $fn$
            BEGIN
                IF coalesce(current_setting('consumer_kit.outbox_notify', true), '') <> 'off' THEN
                    -- identical notifications in one transaction are folded: one per commit
                    PERFORM pg_notify({channel}, '');
                END IF;
                RETURN NULL;
            END
            $fn$;
        """,
    ),
    (
        104,
        # The relay's claim probes partial indexes in index order only (see consumer_kit.outbox_relay.store):
        # due unkeyed rows get their own index for ordered relaying, and the (partition_key, id)
        # index no statement uses any more goes (one index fewer to write per row).
        """
        CREATE INDEX IF NOT EXISTS outbox_due_unkeyed_idx
            ON {schema}.outbox (available_at, id) WHERE published_at IS NULL AND partition_key IS NULL;
        DROP INDEX IF EXISTS {schema}.outbox_pending_partition_idx;
        """,
    ),
    (
        105,
        # One outbox belongs to one broker: the relay records the broker it publishes to at its
        # first start and refuses another while events are pending (consumer_kit.outbox_relay.binding).
        """
        CREATE TABLE IF NOT EXISTS {schema}.outbox_broker (
            singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
            broker     text        NOT NULL,
            bound_at   timestamptz NOT NULL DEFAULT now(),
            bound_by   text
        );
        """,
    ),
]
