"""Relay drain benchmark: is the time to drain an outbox backlog linear in its size when the
table's statistics are stale?

``python -m benchmarks.drain_bench [--mode quick|full|smoke] [--sizes 10000 100000] [--history N]
[--out FILE]`` runs it on its own; ``python -m benchmarks run`` runs it as scenario ``drain``.

Per run (one schema for the whole scenario, ``ckb_drain_*`` in database ``ck_bench``):

1. migrate; ``autovacuum_enabled = false`` on the outbox (so autoanalyze cannot fix the statistics
   during the run); optionally load a **published history** (full mode: 10,000,000 rows, like the
   issue's 10M published rows), then ``ANALYZE`` while no row is pending: from then on the
   planner believes there is (almost) nothing pending;
2. for each size N, ordered and unordered back to back (which goes first alternates per N):
   insert N pending rows server-side (ordered: keyed over ``KEYS`` partition keys, ``commit_seq``
   in id order; unordered: no key), ``CHECKPOINT``; record the planner's estimate of pending rows
   against the truth; time a few fresh-cursor claims of ``relay_batch_size`` rows (rolled back,
   like the issue's "one ordered claim of 200") and keep one ``EXPLAIN (ANALYZE, BUFFERS)``;
3. drain with the real relay (:class:`consumer_kit.outbox_relay.relay.Relay`, default settings: batch 200,
   256 publishes in flight, publisher confirms) in a child process on a RabbitMQ vhost of its own
   (created with ``rabbitmqctl`` when it is on PATH, else the default vhost); the destination is a
   durable topic exchange bound to a classic queue that keeps the newest 10,000 messages
   (``x-max-length``, ``drop-head``), so the broker persists every message and memory stays
   bounded. The child wraps the store's ``claim`` to time every claim and stops once N rows are
   marked published. Drain seconds run from the first claim's start to the last mark;
4. check nothing is pending, then ``VACUUM`` (not ANALYZE) the outbox outside the timing, as an
   autovacuum between bursts would, leaving the statistics as stale as before.

Figures: drain seconds, rows/s, relay CPU seconds per 1,000 rows, per-claim latency (p50/p95/max
ms over every claim of the drain), rows/s per tenth of the drain (a drain that slows as it goes
shows falling tenths), and seconds per 1,000 rows relative to the smallest N (1.0 = linear).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlparse, urlunparse

import psycopg
from psycopg import sql

from benchmarks import common

logger = logging.getLogger("benchmarks.drain")
ROOT = Path(__file__).resolve().parents[1]

KEYS = 1000
SINK_MAX_LENGTH = 10_000
PROBES = 2
EXCHANGE = "ckb.drain"

SIZES = {"smoke": [2_000], "quick": [10_000, 30_000, 100_000], "full": [10_000, 100_000, 1_000_000]}
HISTORY = {"smoke": 0, "quick": 0, "full": 10_000_000}


# -- the broker: a vhost of its own -----------------------------------------------------------


def _rabbitmqctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60)


def open_vhost() -> tuple[str, str | None]:
    """``(amqp_url, vhost created)``: a fresh vhost when ``rabbitmqctl`` is on PATH (only
    ``add_vhost``, ``set_permissions -p`` and later ``delete_vhost`` of that vhost), else the
    harness's URL as it is."""
    if shutil.which("rabbitmqctl") is None:
        return common.AMQP_URL, None
    vhost = "ckb-drain-" + uuid.uuid4().hex[:8]
    base = urlparse(common.AMQP_URL)
    if _rabbitmqctl("add_vhost", vhost).returncode != 0:
        return common.AMQP_URL, None
    _rabbitmqctl("set_permissions", "-p", vhost, base.username or "guest", ".*", ".*", ".*")
    return urlunparse(base._replace(path="/" + quote(vhost, safe=""))), vhost


def close_vhost(vhost: str | None) -> None:
    if vhost:
        _rabbitmqctl("delete_vhost", vhost)


async def _declare_sink(url: str) -> None:
    import aio_pika

    conn = await aio_pika.connect(url)
    try:
        channel = await conn.channel()
        exchange = await channel.declare_exchange(EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(
            "ckb.drain.sink", durable=True,
            arguments={"x-max-length": SINK_MAX_LENGTH, "x-overflow": "drop-head"},
        )
        await queue.bind(exchange, "#")
    finally:
        await conn.close()


async def _sink_depth(url: str) -> int:
    import aio_pika

    conn = await aio_pika.connect(url)
    try:
        channel = await conn.channel()
        queue = await channel.declare_queue("ckb.drain.sink", passive=True)
        await queue.purge()
        return int(queue.declaration_result.message_count or 0)
    finally:
        await conn.close()


# -- the outbox ---------------------------------------------------------------------------------


def _table(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, "outbox")


def prepare(db_url: str, schema: str, history: int) -> dict[str, Any]:
    """Migrate ``schema``, switch autovacuum off on its outbox, load ``history`` published rows,
    ANALYZE with nothing pending. Returns what was done and how long it took."""
    common.create_schema(db_url, schema)
    started = time.perf_counter()
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql.SQL(
            "ALTER TABLE {} SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)"
        ).format(_table(schema)))
        # A little published history even in quick mode: the ANALYZE below then sees a table
        # with rows, none of them pending (null fraction of published_at: 0).
        _insert(conn, schema, max(history, 100), keyed=True, published=True)
        conn.execute(sql.SQL("ANALYZE {}").format(_table(schema)))
        conn.execute("CHECKPOINT")
    return {"history_rows": max(history, 100), "prepare_seconds": round(time.perf_counter() - started, 1)}


def _insert(conn: psycopg.Connection[Any], schema: str, n: int, *, keyed: bool, published: bool) -> None:
    """Insert ``n`` rows server-side in chunks of 1,000,000 (user triggers off: ``commit_seq`` is
    drawn here in id order, which is the commit order the trigger would give one writer)."""
    table = _table(schema)
    conn.execute(sql.SQL("ALTER TABLE {} DISABLE TRIGGER USER").format(table))
    try:
        done = 0
        while done < n:
            chunk = min(1_000_000, n - done)
            conn.execute(
                sql.SQL(
                    "INSERT INTO {table} (event_id, destination, routing_key, message_type, partition_key, "
                    "payload, commit_seq, published_at) "
                    "SELECT gen_random_uuid(), %(dest)s, 'invoice.created', 'InvoiceCreated', "
                    "CASE WHEN %(keyed)s THEN 'c' || (g %% %(keys)s) END, "
                    "jsonb_build_object('invoice_id', g, 'order_id', g, 'customer_id', 'c' || (g %% %(keys)s), "
                    "'amount_cents', 1000 + g %% 97), "
                    "CASE WHEN %(keyed)s THEN nextval({seq}) END, "
                    "CASE WHEN %(published)s THEN now() - interval '1 day' END "
                    "FROM generate_series(1, %(n)s) AS g"
                ).format(table=table, seq=sql.Literal(f"{schema}.outbox_commit_seq")),
                {"dest": EXCHANGE, "keyed": keyed, "keys": KEYS, "published": published, "n": chunk},
            )
            done += chunk
    finally:
        conn.execute(sql.SQL("ALTER TABLE {} ENABLE TRIGGER USER").format(table))


def staleness(conn: psycopg.Connection[Any], schema: str, pending: int) -> dict[str, Any]:
    """What the planner believes about the outbox against the truth."""
    row = conn.execute(
        "SELECT c.reltuples::bigint, s.n_live_tup, s.n_dead_tup, s.last_analyze IS NOT NULL, "
        "s.last_autoanalyze IS NOT NULL FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid "
        "WHERE c.oid = %s::regclass",
        (f"{schema}.outbox",),
    ).fetchone()
    assert row is not None
    plan = conn.execute(sql.SQL(
        "EXPLAIN (FORMAT JSON) SELECT id FROM {} WHERE published_at IS NULL").format(_table(schema))
    ).fetchone()
    estimate = plan[0][0]["Plan"]["Plan Rows"] if plan else None
    return {"reltuples": row[0], "n_live_tup": row[1], "n_dead_tup": row[2], "analyzed": row[3],
            "autoanalyzed": row[4], "planner_pending_estimate": estimate, "pending_actual": pending}


PROBE_TIMEOUT_MS = 5_000


async def probe_claims(db_url: str, schema: str, *, ordered: bool, batch: int,
                       pgoptions: str | None = None) -> dict[str, Any]:
    """Time ``PROBES`` claims of ``batch`` rows from a fresh cursor: the relay's claim statement
    with the planner settings the store gives it (``PLAN_BY_INDEX_ORDER``) in
    a session like the relay's (``pgoptions``), each in a transaction that is rolled back so the
    backlog is untouched; and EXPLAIN one of them. A probe is cut at ``PROBE_TIMEOUT_MS``
    (reported as ``None``; the plan is then EXPLAINed without ANALYZE)."""
    from consumer_kit.outbox_relay import statements
    from consumer_kit.outbox_relay import store as store_module

    s = store_module.OutboxStore(schema, relay_id="probe", max_attempts=10, claim_timeout=30.0,
                                 backoff_base=1.0, backoff_max=60.0)
    query = s._claim_ordered_from_start if ordered else s._claim_unordered
    settings = list(statements.PLAN_BY_INDEX_ORDER)
    start = store_module._FROM_START
    window = max(4 * batch, 100)
    params = {"relay_id": "probe", "lease": 30.0, "max_attempts": 10, "limit": batch, "keys": window,
              "window": window, "after_key": "", "after_at": start[0], "after_id": start[1]}
    times: list[float | None] = []
    rows = 0
    options = f"{pgoptions or ''} -c statement_timeout={PROBE_TIMEOUT_MS}".strip()
    async with await psycopg.AsyncConnection.connect(db_url, options=options, autocommit=True) as conn:

        async def in_rolled_back_transaction(statement: Any) -> list[Any]:
            async with conn.transaction(force_rollback=True):
                for setting in settings:
                    await conn.execute(setting)
                cur = await conn.execute(statement, params)
                return await cur.fetchall()

        for _ in range(PROBES):
            t0 = time.perf_counter()
            try:
                rows = sum(1 for r in await in_rolled_back_transaction(query) if r[0] is not None)
                times.append(round((time.perf_counter() - t0) * 1000, 2))
            except psycopg.errors.QueryCanceled:
                times.append(None)
        analyze = times[-1] is not None
        explain = "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) " if analyze else "EXPLAIN (COSTS OFF) "
        plan = "\n".join(r[0] for r in await in_rolled_back_transaction(sql.SQL(explain) + query))
    buffers = [ln.strip() for ln in plan.splitlines() if ln.strip().startswith("Buffers:")]
    scans = sorted({ln.strip().lstrip("-> ").split("  (")[0].split(" (")[0]
                    for ln in plan.splitlines() if " using " in ln})
    return {"claim_ms": times, "rows": rows, "timeout_ms": PROBE_TIMEOUT_MS, "session": options,
            "planner_settings": [x.decode() if isinstance(x, bytes) else str(x) for x in settings],
            "plan_indexes": scans, "plan_sorts": plan.count("Sort Key:"),
            "plan_top_buffers": buffers[0] if buffers else None, "explain_analyzed": analyze,
            "explain": plan}


def pending_count(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NULL").format(
        _table(schema))).fetchone()
    return int(row[0]) if row else -1


# -- the drain: the relay in a child process ---------------------------------------------------


def candidate_mark_published(schema: str) -> sql.Composed:
    """A candidate for the relay's mark statement, measured with ``--candidate-mark`` (NOT what
    the relay ships): the shipped ``WHERE id = ANY(ids) AND published_at IS NULL`` lets stale
    statistics pick a full scan of a partial index on ``published_at IS NULL`` (they say it holds
    about one row), O(backlog) per mark; the same test written so that no partial index
    predicate matches leaves the primary key as the only index that fits."""
    return sql.SQL(
        "UPDATE {} SET published_at = now(), attempts = attempts + 1, claimed_by = %(relay_id)s, "
        "claimed_until = NULL WHERE id = ANY(%(ids)s) "
        "AND coalesce(published_at, '-infinity'::timestamptz) = '-infinity'::timestamptz"
    ).format(_table(schema))



def drain(db_url: str, amqp_url: str, schema: str, *, n: int, ordered: bool, timeout: float,
          pgoptions: str | None = None, candidate_mark: bool = False) -> dict[str, Any]:
    """Run the relay child until ``n`` rows are marked published (or ``timeout`` seconds pass, or
    one claim takes over 5 s); its JSON result plus the wall time of the whole child (start-up
    included). ``pgoptions``: the relay's PostgreSQL session settings (``PGOPTIONS``)."""
    cmd = [sys.executable, "-m", "benchmarks.drain_bench", "relay", "--schema", schema,
           "--expect", str(n), "--database-url", db_url, "--broker-url", amqp_url,
           "--ordered" if ordered else "--unordered", "--timeout", str(timeout)]
    if candidate_mark:
        cmd.append("--candidate-mark")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if pgoptions:
        env["PGOPTIONS"] = pgoptions
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout + 60)
    wall = time.perf_counter() - started
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"relay child rc={proc.returncode}: {proc.stderr[-800:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    result["child_wall_seconds"] = round(wall, 2)
    return result


async def relay_child(args: argparse.Namespace) -> dict[str, Any]:
    """The relay as ``outbox-relay`` runs it (default settings), its store's claim timed."""
    from consumer_kit.outbox_relay.relay import Relay
    from consumer_kit.outbox_relay.settings import RelaySettings

    settings = RelaySettings(
        database_url=args.database_url, broker_url=args.broker_url, db_schema=args.schema,
        relay_ordered=args.ordered, relay_id="drain-bench", relay_poll_interval=0.5,
    )
    relay = Relay(settings)
    if args.candidate_mark:
        relay.store._mark_published = candidate_mark_published(args.schema)
    claims: list[tuple[float, float, int]] = []  # (wall start, seconds, rows)
    batches: list[tuple[float, int]] = []  # (wall end, rows marked)
    claim = relay.store.claim
    relay_batch = relay.relay_batch

    slow: list[float] = []

    async def timed_claim(conn: Any, limit: int, *, ordered: bool = True) -> Any:
        wall, t0 = time.time(), time.perf_counter()
        rows = await claim(conn, limit, ordered=ordered)
        took = time.perf_counter() - t0
        claims.append((wall, took, len(rows)))
        if took > args.max_claim_seconds:  # a drain this slow would not end in the budget
            slow.append(took)
            relay.request_stop()
        return rows

    async def counted_batch() -> tuple[int, int]:
        claimed, marked = await relay_batch()
        if claimed:
            batches.append((time.time(), marked))
        if relay.counters["published"] >= args.expect:
            relay.request_stop()
        return claimed, marked

    marks: list[float] = []  # seconds per mark_published statement
    mark = relay.store.mark_published

    async def timed_mark(conn: Any, ids: Any) -> int:
        t0 = time.perf_counter()
        n = await mark(conn, ids)
        marks.append(time.perf_counter() - t0)
        return n

    relay.store.mark_published = timed_mark  # type: ignore[method-assign]
    relay.store.claim = timed_claim  # type: ignore[method-assign]
    relay.relay_batch = counted_batch  # type: ignore[method-assign]
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        await asyncio.wait_for(relay.run(), args.timeout)
    except TimeoutError:
        logger.warning("drain timed out after %s s", args.timeout)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    published = int(relay.counters["published"])
    if not claims or not batches:
        return {"published": published, "error": "nothing claimed",
                "claim_ms_seen": [round(c[1] * 1000, 1) for c in claims[:5]]}
    start, end = claims[0][0], batches[-1][0]
    seconds = end - start
    ms = sorted(c[1] * 1000 for c in claims if c[2] > 0)
    empty = sum(1 for c in claims if c[2] == 0)
    q = statistics.quantiles(ms, n=100) if len(ms) >= 2 else [ms[0]] * 99
    # rows/s per tenth of the drain, from the batches' end times
    tenths: list[float] = []
    progress = [(start, 0)]
    total = 0
    for at, k in batches:
        total += k
        progress.append((at, total))
    for d in range(10):
        lo, hi = total * d / 10, total * (d + 1) / 10
        t_lo = next(at for at, c in progress if c >= lo)
        t_hi = next(at for at, c in progress if c >= hi)
        tenths.append(round((hi - lo) / (t_hi - t_lo)) if t_hi > t_lo else 0)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    unfinished = published < args.expect
    return {
        "published": published, "expected": args.expect, "ordered": args.ordered,
        "finished": not unfinished,
        "stopped_because": None if not unfinished else (
            f"a claim took {slow[0]:.1f} s (limit {args.max_claim_seconds:g} s)" if slow
            else f"time limit of {args.timeout:g} s"),
        # an unfinished drain has no drain time; its rate is what it reached before it stopped
        "drain_seconds": None if unfinished else round(seconds, 3),
        "rows_per_s": round(published / seconds) if seconds else None,
        "claims": len(ms), "empty_claims": empty,
        "claim_ms": {"p50": round(q[49], 2), "p95": round(q[94], 2), "max": round(ms[-1], 2),
                     "first": round(claims[0][1] * 1000, 2), "mean": round(statistics.fmean(ms), 2)},
        "rows_per_claim": round(published / len(ms), 1) if ms else None,
        "mark_ms": _quantiles([m * 1000 for m in marks]),
        # shares of the drain's wall time spent in the claim and the mark statements (the rest:
        # publishing with confirms, and the relay's own Python)
        "claim_share": round(sum(ms) / 1000 / seconds, 3) if seconds else None,
        "mark_share": round(sum(marks) / seconds, 3) if seconds else None,
        "rows_per_s_by_tenth": tenths,
        "relay_cpu_seconds": round(cpu, 2),
        "relay_cpu_ms_per_1000_rows": round(cpu / published * 1e6, 1) if published else None,
        "settings": {"batch": settings.relay_batch_size, "max_in_flight": settings.relay_max_in_flight,
                     "claim_timeout": settings.relay_claim_timeout},
        "counters": relay.counters.snapshot(),
    }


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)
    q = statistics.quantiles(v, n=100) if len(v) >= 2 else [v[0]] * 99
    return {"p50": round(q[49], 2), "p95": round(q[94], 2), "max": round(v[-1], 2)}


# -- the scenario --------------------------------------------------------------------------------


def drain_timeout(n: int) -> float:
    """Seconds a drain of ``n`` rows may take before it is stopped as unfinished: 20 s plus
    2 ms per row (a linear relay on 2 cores needs about a tenth of that)."""
    return 20.0 + n / 500.0


def run(mode: str, *, sizes: list[int] | None = None, history: int | None = None,
        relay_pgoptions: str | None = None, statistics_mode: str = "stale",
        candidate_mark: bool = False) -> dict[str, Any]:
    """The drain scenario for ``mode`` (``smoke``, ``quick``, ``full``); returns its results.
    ``relay_pgoptions``: PostgreSQL session settings for the relay (``PGOPTIONS``), to measure a
    candidate plan fix without changing the relay; default none (the relay as shipped).
    ``statistics_mode``: ``stale`` (the scenario) or ``analyzed`` (a control: ANALYZE after each
    fill, so the planner knows the backlog). ``candidate_mark``: the relay marks rows with
    :func:`candidate_mark_published` instead of its own statement (a measured proposal)."""
    sizes = sizes or SIZES[mode]
    history = HISTORY[mode] if history is None else history
    db_url = common.ensure_database()
    schema = common.new_name("ckb_drain")
    amqp_url, vhost = open_vhost()
    out: dict[str, Any] = {"sizes": sizes, "keys": KEYS, "sink_max_length": SINK_MAX_LENGTH,
                           "vhost": vhost or urlparse(amqp_url).path or "/",
                           "relay_pgoptions": relay_pgoptions, "statistics": statistics_mode,
                           "candidate_mark": candidate_mark, "runs": {}}
    try:
        asyncio.run(_declare_sink(amqp_url))
        out.update(prepare(db_url, schema, history))
        logger.info("drain: schema %s prepared (%s history rows) in %.1f s", schema,
                    out["history_rows"], out["prepare_seconds"])
        for i, n in enumerate(sizes):
            variants = [True, False] if i % 2 == 0 else [False, True]
            for ordered in variants:
                name = f"{'ordered' if ordered else 'unordered'}_{n}"
                out["runs"][name] = one_run(db_url, amqp_url, schema, n=n, ordered=ordered,
                                            pgoptions=relay_pgoptions, candidate_mark=candidate_mark,
                                            analyze=statistics_mode == "analyzed")
                r = out["runs"][name]
                logger.info("drain %s: %s s, %s rows/s, claim p50 %s ms", name, r.get("drain_seconds"),
                            r.get("rows_per_s"), (r.get("claim_ms") or {}).get("p50"))
        out["linearity"] = linearity(out["runs"], sizes)
    finally:
        common.drop_schema(db_url, schema)
        close_vhost(vhost)
    out["load_average_1min"] = round(os.getloadavg()[0], 2)
    return out


def one_run(db_url: str, amqp_url: str, schema: str, *, n: int, ordered: bool,
            pgoptions: str | None = None, analyze: bool = False, candidate_mark: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    with psycopg.connect(db_url, autocommit=True) as conn:
        _insert(conn, schema, n, keyed=ordered, published=False)
        if analyze:
            conn.execute(sql.SQL("ANALYZE {}").format(_table(schema)))
        conn.execute("CHECKPOINT")
        stale = staleness(conn, schema, n)
    fill = time.perf_counter() - t0
    probe = asyncio.run(probe_claims(db_url, schema, ordered=ordered, batch=200, pgoptions=pgoptions))
    load_before = os.getloadavg()[0]
    result = drain(db_url, amqp_url, schema, n=n, ordered=ordered, timeout=drain_timeout(n),
                   pgoptions=pgoptions, candidate_mark=candidate_mark)
    with psycopg.connect(db_url, autocommit=True) as conn:
        left = pending_count(conn, schema)
        if left:  # an unfinished drain: clear its rows (untimed) so the next run starts clean
            conn.execute(sql.SQL("UPDATE {} SET published_at = now() WHERE published_at IS NULL").format(
                _table(schema)))
        t1 = time.perf_counter()
        conn.execute(sql.SQL("VACUUM {}").format(_table(schema)))
        vacuum = time.perf_counter() - t1
    result.update({
        "n": n, "fill_seconds": round(fill, 1), "statistics": stale, "probe": probe,
        "pending_after": left, "sink_depth": asyncio.run(_sink_depth(amqp_url)),
        "vacuum_seconds": round(vacuum, 1), "load_average_1min_before": round(load_before, 2),
    })
    return result


def linearity(runs: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """Seconds per 1,000 rows at each N relative to the smallest N (1.0 = linear)."""
    out: dict[str, Any] = {}
    for kind in ("ordered", "unordered"):
        per_k = {n: runs.get(f"{kind}_{n}", {}).get("drain_seconds") for n in sizes}
        base = per_k[sizes[0]]
        out[kind] = {str(n): round((s / n) / (base / sizes[0]), 2) if s and base else None
                     for n, s in per_k.items()}
    return out


# -- report --------------------------------------------------------------------------------------


def report_lines(d: dict[str, Any]) -> list[str]:
    """The Markdown section of scenario ``drain`` (used by :mod:`benchmarks.report`)."""
    if not d or not d.get("runs"):
        return [f"Drain scenario: {d.get('error', 'not run')}", ""] if d else []
    stale = d.get("statistics", "stale") == "stale"
    lines = [
        "## 8. Relay drain time against backlog size"
        + (" (stale statistics)" if stale else " (control: statistics analyzed after each fill)"),
        "",
        f"One relay process (default settings: batch {_first(d, 'settings', 'batch')}, "
        f"{_first(d, 'settings', 'max_in_flight')} publishes in flight, confirms) drains N pending "
        f"rows to a topic exchange on vhost `{d.get('vhost')}`. Published history before the "
        f"backlog: {d.get('history_rows', 0):,} rows. "
        + ("`ANALYZE` ran with nothing pending and autovacuum is off on the table, so the planner "
           "believes (almost) nothing is pending (estimate column). " if stale else
           "`ANALYZE` after each fill (the planner knows the backlog). ")
        + f"Ordered: {d['keys']:,} partition keys. Relay session settings: "
        f"`{d.get('relay_pgoptions') or 'none (as shipped)'}`; mark statement: "
        + ("**candidate** (`coalesce(published_at, '-infinity') = '-infinity'` instead of "
           "`published_at IS NULL`, see `candidate_mark_published`), not the shipped one. "
           if d.get("candidate_mark") else "as shipped. ")
        + "Runs that hit a limit (a claim over "
        "5 s, or 20 s + 2 ms per row) show no drain time and the rate they reached.",
        "",
        "| backlog N | ordering | planner's pending estimate | drain s | rows/s | s per 1k rows vs smallest N "
        "| claim p50 / p95 / max ms | mark p50 / max ms | fresh-cursor claim of 200, ms "
        "| relay CPU ms / 1k rows |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lin = d.get("linearity", {})
    for r in d["runs"].values():
        if "n" not in r:
            lines.append(f"| ? | ? | | {r.get('error', '')[:100]} | | | | | | |")
            continue
        kind = "ordered" if r.get("ordered", True) else "unordered"
        c = r.get("claim_ms") or {}
        m = r.get("mark_ms") or {}
        drain_s = r.get("drain_seconds")
        if drain_s is None:
            drain_s = f"unfinished: {r.get('published', 0):,} rows, {r.get('stopped_because') or r.get('error', '')[:80]}"
        probes = " / ".join(">5 s" if t is None else str(t) for t in r.get("probe", {}).get("claim_ms", []))
        lines.append(
            f"| {r['n']:,} | {kind} | {r['statistics'].get('planner_pending_estimate')} | "
            f"{drain_s} | {_num(r.get('rows_per_s'))} | {lin.get(kind, {}).get(str(r['n']))} | "
            f"{c.get('p50')} / {c.get('p95')} / {c.get('max')} | {m.get('p50')} / {m.get('max')} | "
            f"{probes} | {r.get('relay_cpu_ms_per_1000_rows')} |"
        )
    lines += ["", "Rows/s per tenth of each drain (a drain slowed by its backlog shows rising tenths, "
              "as the backlog shrinks):", ""]
    for name, r in d["runs"].items():
        if r.get("rows_per_s_by_tenth"):
            lines.append(f"- {name}: {', '.join(f'{v:,}' for v in r['rows_per_s_by_tenth'])}")
    lines.append("")
    return lines


def _num(v: Any) -> str:
    return "n/a" if v is None else f"{v:,}"


def _first(d: dict[str, Any], *path: str) -> Any:
    for r in d.get("runs", {}).values():
        v: Any = r
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if v is not None:
            return v
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.drain_bench")
    sub = parser.add_subparsers(dest="command")
    child = sub.add_parser("relay", help="(internal) the relay child process")
    child.add_argument("--schema", required=True)
    child.add_argument("--expect", type=int, required=True)
    child.add_argument("--database-url", required=True)
    child.add_argument("--broker-url", required=True)
    child.add_argument("--ordered", dest="ordered", action="store_true", default=True)
    child.add_argument("--unordered", dest="ordered", action="store_false")
    child.add_argument("--timeout", type=float, default=600.0)
    child.add_argument("--max-claim-seconds", type=float, default=5.0)
    child.add_argument("--candidate-mark", action="store_true")
    parser.add_argument("--mode", choices=sorted(SIZES), default="quick")
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--history", type=int, default=None)
    parser.add_argument("--relay-pgoptions", default=None,
                        help="PostgreSQL session settings for the relay, e.g. '-c enable_sort=off'")
    parser.add_argument("--statistics", choices=["stale", "analyzed"], default="stale",
                        help="stale (the scenario) or analyzed (control: ANALYZE after each fill)")
    parser.add_argument("--candidate-mark", action="store_true",
                        help="mark rows with candidate_mark_published() (a proposal, not the shipped relay)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up the schema and vhost
    if args.command == "relay":
        logging.getLogger().setLevel(logging.WARNING)
        print(json.dumps(asyncio.run(relay_child(args))), flush=True)
        return 0
    results = run(args.mode, sizes=args.sizes, history=args.history, relay_pgoptions=args.relay_pgoptions,
                  statistics_mode=args.statistics, candidate_mark=args.candidate_mark)
    results["mode"] = args.mode
    results["started_by"] = "python -m benchmarks.drain_bench"
    text = json.dumps(results, indent=2, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".md").write_text("\n".join(report_lines(results)) + "\n")
    print(text if not args.out else f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
