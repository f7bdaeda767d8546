"""Runs every benchmark scenario in one process and returns one results dict.

Each throughput figure comes from a consumer *process* (``benchmarks.consumers``) draining a
pre-filled quorum queue; variants alternate inside each round, so a round's ratio compares runs
made seconds apart on the same RabbitMQ and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks import batch_bench, common
from benchmarks.common import (
    declare_and_fill,
    delete_queues,
    delete_redis_keys,
    drop_schema,
    effect_counts,
    message_body,
    new_name,
    paired_ratio,
    summarize,
)
from benchmarks.pgbench_scripts import PGBENCH_CK, PGBENCH_NAIVE

logger = logging.getLogger("benchmarks.runner")
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mode:
    name: str
    messages: int  # per throughput round
    rounds: int
    concurrencies: list[int]
    ledger_sizes: list[int]
    pgbench_seconds: int
    memory_messages: int
    crash_messages: int
    crash_kills: int
    relay_events: int
    relay_rate: int
    relay_seconds: float
    relay: bool = True
    notes: list[str] = field(default_factory=list)


MODES = {
    "smoke": Mode("smoke", messages=200, rounds=1, concurrencies=[8], ledger_sizes=[0, 10_000],
                  pgbench_seconds=1, memory_messages=300, crash_messages=150, crash_kills=1,
                  relay_events=0, relay_rate=0, relay_seconds=0, relay=False,
                  notes=["smoke: a few hundred messages, one round; figures are not meaningful",
                         "smoke: ledger pre-filled with 10,000 rows only; relay scenario skipped"]),
    "quick": Mode("quick", messages=2500, rounds=3, concurrencies=[1, 8, 32],
                  ledger_sizes=[0, 1_000_000, 10_000_000], pgbench_seconds=5, memory_messages=20_000,
                  crash_messages=1500, crash_kills=6, relay_events=3000, relay_rate=500,
                  relay_seconds=3,
                  notes=["quick: memory steady state over 20,000 messages (100,000 in the full run)",
                         "quick: relay backlog of 3,000 events; no 10,000,000-row outbox pre-fill"]),
    "full": Mode("full", messages=10_000, rounds=5, concurrencies=[1, 8, 32],
                 ledger_sizes=[0, 1_000_000, 10_000_000], pgbench_seconds=15,
                 memory_messages=100_000, crash_messages=5000, crash_kills=12, relay_events=10_000,
                 relay_rate=1000, relay_seconds=5),
}


class OrderIds:
    """Fresh order ids: every round uses keys no earlier round used (no accidental duplicates)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> range:
        r = range(self.next, self.next + n)
        self.next += n
        return r


# -- one consumer run -------------------------------------------------------------------------


def run_consumer(
    variant: str, queue: str, schema: str, concurrency: int, expect: int, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    timeout = max(60.0, expect / 100.0)
    cmd = [sys.executable, "-m", "benchmarks.consumers", variant, "--queue", queue, "--schema", schema,
           "--concurrency", str(concurrency), "--expect", str(expect), "--timeout", str(timeout), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout + 60,
                          env=_child_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        logger.warning("%s consumer failed (rc=%s): %s", variant, proc.returncode, proc.stderr[-2000:])
        return {"processed": 0, "rate": None, "peak_rss_mb": None, "error": proc.stderr[-500:]}
    result = json.loads(lines[-1])
    if result["processed"] < expect:
        result["rate"] = None
        result["error"] = f"only {result['processed']} of {expect} in {timeout:.0f} s"
    return result


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def measure(
    variant: str, ids: range, concurrency: int, *, schema: str, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Fill a fresh queue with one message per id, drain it with ``variant``, clean up the queue."""
    queue = new_name("ckbq")
    try:
        asyncio.run(declare_and_fill(queue, (message_body(i) for i in ids)))
        return run_consumer(variant, queue, schema, concurrency, len(ids), extra)
    finally:
        asyncio.run(delete_queues(queue))


# -- scenarios 1 and 2 ------------------------------------------------------------------------

VARIANTS = ("naive", "ck", "powertools")


def scenario_idempotency(mode: Mode, db_url: str) -> dict[str, Any]:
    """Cost of idempotency (1) and, at concurrency 8, the duplicate path (2)."""
    out: dict[str, Any] = {"by_concurrency": {}, "duplicate": {}}
    for c in mode.concurrencies:
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        cpus: dict[str, list[float]] = {v: [] for v in VARIANTS}
        dup_rates: list[float] = []
        first_rates: list[float] = []
        dup_cpus: list[float] = []
        first_cpus: list[float] = []
        errors: list[str] = []
        for r in range(mode.rounds):
            order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                schema = new_name()
                common.create_schema(db_url, schema)
                try:
                    ids = range(1, mode.messages + 1)
                    res = measure(variant, ids, c, schema=schema)
                    if res.get("rate"):
                        rates[variant].append(res["rate"])
                        cpus[variant].append(res["cpu_us_per_delivery"])
                    else:
                        errors.append(f"{variant} c={c} round {r}: {res.get('error', '')[:200]}")
                    if variant == "ck" and c == 8 and res.get("rate"):
                        # (2) the same operations again: every delivery is a duplicate
                        dup = measure("ck", ids, c, schema=schema)
                        if dup.get("rate"):
                            first_rates.append(res["rate"])
                            dup_rates.append(dup["rate"])
                            first_cpus.append(res["cpu_us_per_delivery"])
                            dup_cpus.append(dup["cpu_us_per_delivery"])
                        counts = effect_counts(db_url, schema)
                        if counts["more_than_once"]:
                            errors.append(f"duplicate run applied {counts['more_than_once']} twice")
                finally:
                    if variant == "powertools":
                        delete_redis_keys(schema)
                    drop_schema(db_url, schema)
            logger.info("c=%s round %s: %s", c, r, {v: rates[v][-1:] for v in VARIANTS})
        entry = {v: summarize(rates[v]) for v in VARIANTS}
        entry["cpu_us"] = {v: summarize(cpus[v]) for v in VARIANTS}
        n = min(len(rates["ck"]), len(rates["naive"]))
        entry["ratio_ck_naive"] = paired_ratio(rates["ck"][:n], rates["naive"][:n])
        n = min(len(rates["ck"]), len(rates["powertools"]))
        entry["ratio_ck_powertools"] = paired_ratio(rates["ck"][:n], rates["powertools"][:n])
        entry["errors"] = errors
        out["by_concurrency"][str(c)] = entry
        if dup_rates:
            out["duplicate"] = {
                "concurrency": c,
                "first_execution": summarize(first_rates),
                "duplicate": summarize(dup_rates),
                "ratio": paired_ratio(dup_rates, first_rates),
                "cpu_us": {"first_execution": summarize(first_cpus), "duplicate": summarize(dup_cpus)},
            }
    return out


# -- scenario 3: ledger size ------------------------------------------------------------------


def prefill_ledger(db_url: str, schema: str, start: int, count: int) -> float:
    """COPY ``count`` completed ledger rows (keys interleaved with the benchmark's keys) into
    ``schema``.operations. The primary key is dropped for the load and rebuilt. Returns seconds."""
    started = time.perf_counter()
    scope = "default/invoice.create/v1"
    table = sql.Identifier(schema, "operations")
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT operations_pkey").format(table))
        with conn.cursor() as cur:
            with cur.copy(
                sql.SQL(
                    "COPY {} (scope, key, tenant, operation_type, fingerprint, projection_version, "
                    "state, result_status, result_reference, completed_at) FROM STDIN"
                ).format(table)
            ) as copy:
                chunk: list[str] = []
                for i in range(start, start + count):
                    # "order-<n>-rev-0": sorts among the benchmark's "order-<n>-rev-1" keys
                    chunk.append(
                        f"{scope}\torder-{i}-rev-0\tdefault\tinvoice.create\t{i * 2654435761:064x}"
                        f"\t1\tcompleted\tcreated\t{i}\t2026-01-01 00:00:00+00\n"
                    )
                    if len(chunk) >= 50_000:
                        copy.write("".join(chunk))
                        chunk.clear()
                if chunk:
                    copy.write("".join(chunk))
        conn.execute(sql.SQL("ALTER TABLE {} ADD PRIMARY KEY (scope, key)").format(table))
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table))
        # Flush the load's dirty pages now, so no checkpoint lands inside a measured round.
        conn.execute("CHECKPOINT")
    return time.perf_counter() - started


def explain_claim(db_url: str, schema: str) -> str:
    """EXPLAIN ANALYZE of the runtime's claim statement (a fresh key, rolled back)."""
    from consumer_kit.ledger import Ledger

    ledger = Ledger(schema)
    params = {
        "scope": "default/invoice.create/v1", "key": "order-424242424-rev-9", "tenant": "default",
        "operation_type": "invoice.create", "fingerprint": "0" * 64, "projection_version": 1,
        "owner": "bench", "lease": 300.0, "message_id": "m", "watch": False,
        "body_keep": None, "key_keep": None,
    }
    with psycopg.connect(db_url) as conn:
        query = b"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + ledger._sql.claim  # rendered bytes
        rows = conn.execute(query, params).fetchall()
        conn.rollback()
    return "\n".join(r[0] for r in rows)


def scenario_ledger(mode: Mode, db_url: str) -> dict[str, Any]:
    """Throughput of consumer-kit at concurrency 8 as the ledger grows (3).

    Two schemas: ``empty`` (only the benchmark's own rows) and ``filled`` (pre-filled by COPY to
    each size in turn). Every round measures both back to back, alternating which goes first, so
    the ratio compares runs made seconds apart."""
    empty, filled = new_name(), new_name()
    common.create_schema(db_url, empty)
    common.create_schema(db_url, filled)
    ids = OrderIds()
    out: dict[str, Any] = {"sizes": {}, "concurrency": 8, "prefill_seconds": {}}
    loaded = 0
    try:
        for size in [s for s in mode.ledger_sizes if s > 0]:
            out["prefill_seconds"][str(size)] = round(prefill_ledger(db_url, filled, loaded, size - loaded), 1)
            logger.info("ledger pre-filled to %s rows in %.1f s", size, out["prefill_seconds"][str(size)])
            loaded = size
            rates: dict[str, list[float]] = {"empty": [], "filled": []}
            for r in range(mode.rounds):
                pair: dict[str, float | None] = {}
                for which in (("empty", "filled") if r % 2 == 0 else ("filled", "empty")):
                    res = measure("ck", ids.take(mode.messages), 8, schema=empty if which == "empty" else filled)
                    pair[which] = res.get("rate")
                if pair["empty"] and pair["filled"]:
                    rates["empty"].append(pair["empty"])
                    rates["filled"].append(pair["filled"])
            out["sizes"][str(size)] = {
                "empty": summarize(rates["empty"]),
                "filled": summarize(rates["filled"]),
                "ratio_to_empty": paired_ratio(rates["filled"], rates["empty"]),
            }
        out["explain_claim"] = explain_claim(db_url, filled)
        out["index_bound"] = "Seq Scan" not in out["explain_claim"]
    finally:
        drop_schema(db_url, empty)
        drop_schema(db_url, filled)
    return out


# -- scenario 5: pgbench ----------------------------------------------------------------------

def scenario_pgbench(mode: Mode, db_url: str) -> dict[str, Any]:
    """pgbench with the consumer-kit-shaped and the naive-shaped transaction (5)."""
    schema = new_name()
    common.create_schema(db_url, schema)
    out: dict[str, Any] = {"seconds": mode.pgbench_seconds, "runs": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for shape, script in (("ck", PGBENCH_CK), ("naive", PGBENCH_NAIVE)):
                path = Path(tmp) / f"{shape}.sql"
                path.write_text(script)
                for clients in (1, 8):
                    tps = common.pgbench(db_url, schema, path, clients, mode.pgbench_seconds)
                    out["runs"][f"{shape}_c{clients}"] = {"shape": shape, "clients": clients, "tps": tps}
            # The outbox's AFTER INSERT trigger NOTIFYs on every commit; PostgreSQL serialises
            # committing transactions that have notified (one global lock). Same script, trigger off:
            _outbox_trigger(db_url, schema, enable=False)
            try:
                for clients in (1, 8):
                    tps = common.pgbench(db_url, schema, Path(tmp) / "ck.sql", clients, mode.pgbench_seconds)
                    out["runs"][f"ck_nonotify_c{clients}"] = {
                        "shape": "ck, outbox NOTIFY trigger disabled", "clients": clients, "tps": tps}
            finally:
                _outbox_trigger(db_url, schema, enable=True)
    finally:
        drop_schema(db_url, schema)
    return out


def _outbox_trigger(db_url: str, schema: str, *, enable: bool) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE {} {} TRIGGER outbox_notify").format(
            sql.Identifier(schema, "outbox"), sql.SQL("ENABLE" if enable else "DISABLE")))


# -- scenario 6: memory -----------------------------------------------------------------------


def scenario_memory(mode: Mode, db_url: str) -> dict[str, Any]:
    """Peak RSS of a consumer-kit worker at concurrency 64 (6); the relay's is measured in
    :func:`scenario_relay_memory`."""
    schema = new_name()
    common.create_schema(db_url, schema)
    try:
        res = measure("ck", range(1, mode.memory_messages + 1), 64, schema=schema)
    finally:
        drop_schema(db_url, schema)
    return {"worker": {"concurrency": 64, "messages": mode.memory_messages,
                       "peak_rss_mb": res.get("peak_rss_mb"), "rate": res.get("rate"),
                       "error": res.get("error")}}


async def _relay_memory(events: int) -> dict[str, Any]:
    import psutil

    from benchmarks import relay_bench
    from consumer_kit.ledger import migrate

    schema = new_name()
    db = relay_bench.DATABASE_URL
    async with await psycopg.AsyncConnection.connect(db, autocommit=True) as conn:
        await migrate(conn, schema)
        try:
            destination = schema + ".events"
            for _ in range(max(1, events // 500)):
                await relay_bench.write(conn, schema, destination, 500, keyed=True)
            procs = await relay_bench.start_relays(schema, 1, True)
            peak = 0.0
            started = time.monotonic()
            try:
                ps = psutil.Process(procs[0].pid)
                table = sql.Identifier(schema, "outbox")
                while time.monotonic() - started < 300:
                    try:
                        peak = max(peak, ps.memory_info().rss / 2**20)
                    except psutil.NoSuchProcess:
                        break
                    cur = await conn.execute(
                        sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NULL").format(table))
                    row = await cur.fetchone()
                    if row and row[0] == 0:
                        break
                    await asyncio.sleep(0.05)
            finally:
                await relay_bench.stop_relays(procs)
        finally:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return {"events": max(1, events // 500) * 500, "peak_rss_mb": peak,
            "seconds": time.monotonic() - started, "note": "sampled every 50 ms with psutil"}


def scenario_relay_memory(events: int) -> dict[str, Any]:
    try:
        return asyncio.run(_relay_memory(events))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        logger.warning("relay memory failed: %s", exc)
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


# -- scenario 7: kill at random ---------------------------------------------------------------


def scenario_crash(mode: Mode, db_url: str) -> dict[str, Any]:
    """SIGKILL consumer-kit and the Powertools variant at random moments (7)."""
    rng = random.Random(5)
    out: dict[str, Any] = {"messages": mode.crash_messages, "kills": mode.crash_kills}
    for variant in ("ck", "powertools"):
        out[variant] = _crash_one(variant, mode, db_url, rng)
    return out


def _crash_one(variant: str, mode: Mode, db_url: str, rng: random.Random) -> dict[str, Any]:
    schema, queue = new_name(), new_name("ckbq")
    common.create_schema(db_url, schema)
    n = mode.crash_messages
    kills = 0
    try:
        asyncio.run(declare_and_fill(queue, (message_body(i) for i in range(1, n + 1))))
        cmd = [sys.executable, "-m", "benchmarks.consumers", variant, "--queue", queue,
               "--schema", schema, "--concurrency", "8", "--expect", "0", "--timeout", "600"]
        # Kill while the backlog is being processed: each process is SIGKILLed once it has applied
        # a random 4-12% of the operations since it started (plus 0-50 ms), so every kill lands
        # mid-drain with deliveries in flight, whatever the machine's speed.
        for _ in range(mode.crash_kills):
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            base = _applied(db_url, schema)
            goal = base + max(1, int(n * rng.uniform(0.04, 0.12)))
            until = time.monotonic() + 30
            while _applied(db_url, schema) < goal and time.monotonic() < until:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.05))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
        before = effect_counts(db_url, schema)  # evidence that the kills landed mid-drain
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        # Powertools' blocked operations never arrive: the drain ends at this deadline.
        drain = 8.0 if mode.name == "smoke" else max(30.0, n / 100.0)
        deadline = time.monotonic() + drain
        counts = effect_counts(db_url, schema)
        while time.monotonic() < deadline:
            counts = effect_counts(db_url, schema)
            if counts["once"] + counts["more_than_once"] >= n:
                break
            time.sleep(0.25)
        time.sleep(1.0)  # let the last acks land
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        counts = effect_counts(db_url, schema)
        applied = counts["once"] + counts["more_than_once"]
        result: dict[str, Any] = {
            "kills": kills,
            "applied_before_final_run": before["once"] + before["more_than_once"],
            "applied_more_than_once": counts["more_than_once"],
            "lost": n - applied,
            "drain_timeout_s": drain,
        }
        if variant == "powertools":
            stuck = _powertools_stuck(schema)
            result["stuck_inprogress"] = stuck
            # A lost operation is one whose record stayed INPROGRESS with nothing committed (its
            # deliveries ran out on IdempotencyAlreadyInProgressError); the other stuck records
            # belong to operations whose PostgreSQL commit landed before the kill: those run a
            # second time once the record expires.
            result["stuck_with_effect_committed"] = max(0, stuck - result["lost"])
        else:
            result["ledger"] = _ledger_states(db_url, schema)
        return result
    finally:
        if variant == "powertools":
            delete_redis_keys(schema)
        drop_schema(db_url, schema)
        asyncio.run(delete_queues(queue))


def _applied(db_url: str, schema: str) -> int:
    counts = effect_counts(db_url, schema)
    return counts["once"] + counts["more_than_once"]


def _powertools_stuck(prefix: str) -> int:
    """Powertools records still INPROGRESS (their operation is blocked until the record expires)."""
    import redis

    client = redis.Redis(host=common.REDIS_HOST, port=common.REDIS_PORT)
    try:
        stuck = 0
        for key in client.scan_iter(match=f"{prefix}#*", count=1000):
            raw = client.get(key)
            if raw and b"INPROGRESS" in raw:
                stuck += 1
        return stuck
    finally:
        client.close()


def _ledger_states(db_url: str, schema: str) -> dict[str, int]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL("SELECT state, count(*) FROM {} GROUP BY state").format(
                sql.Identifier(schema, "operations"))
        ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


# -- scenario 4: relay ------------------------------------------------------------------------


def scenario_relay(mode: Mode) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        from benchmarks import relay_bench
    except ImportError as exc:
        return {"error": f"benchmarks.relay_bench not available: {exc}"}
    try:
        out["outbox_relay"] = asyncio.run(
            relay_bench.main(mode.relay_events, mode.relay_rate, mode.relay_seconds))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        logger.warning("relay_bench failed: %s", exc)
        out["outbox_relay"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    from benchmarks import faststream_outbox_bench

    out["faststream_outbox"] = faststream_outbox_bench.run(mode.relay_events)
    return out


# -- all --------------------------------------------------------------------------------------


def run_all(mode_name: str, only: set[str] | None = None) -> dict[str, Any]:
    mode = MODES[mode_name]
    db_url = common.ensure_database()
    started = time.time()
    results: dict[str, Any] = {
        "mode": asdict(mode),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "services": {"postgresql": _pg_version(db_url), "rabbitmq": common.AMQP_URL.split("@")[-1],
                     "redis": f"{common.REDIS_HOST}:{common.REDIS_PORT}"},
        "scenarios": {},
        "timings_s": {},
    }
    steps = [
        ("idempotency", lambda: scenario_idempotency(mode, db_url)),
        ("ledger", lambda: scenario_ledger(mode, db_url)),
        ("pgbench", lambda: scenario_pgbench(mode, db_url)),
        ("memory", lambda: scenario_memory(mode, db_url)),
        ("crash", lambda: scenario_crash(mode, db_url)),
        ("batch", lambda: batch_bench.scenario_batch(mode, db_url, measure)),
        ("nats_batch", lambda: batch_bench.scenario_nats_batch(mode, db_url, run_consumer)),
    ]
    if mode.relay:
        steps.append(("relay", lambda: scenario_relay(mode)))
        steps.append(("relay_memory", lambda: scenario_relay_memory(mode.relay_events)))
    steps += _scale_steps(mode, db_url)
    results["load_average_1min"] = {"before": round(os.getloadavg()[0], 2)}
    for name, step in steps:
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        logger.info("scenario %s ...", name)
        try:
            results["scenarios"][name] = step()
        except Exception as exc:
            logger.exception("scenario %s failed", name)
            results["scenarios"][name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        results["timings_s"][name] = round(time.perf_counter() - t0, 1)
        # Other processes on the machine skew every figure: keep the load next to them.
        results.setdefault("load_average_1min", {})[name] = round(os.getloadavg()[0], 2)
        logger.info("scenario %s done in %.1f s", name, results["timings_s"][name])
    results["total_s"] = round(time.time() - started, 1)
    return results


def _scale_steps(mode: Mode, db_url: str) -> list[tuple[str, Any]]:
    """Scenarios 8-11: relay drain against backlog size under stale statistics,
    processes on one queue, the outbox NOTIFY switch, uvloop. The smoke run keeps the drain and
    a 2-process scale-out only (the others reuse the same machinery)."""
    from benchmarks import drain_bench, scaleout_bench

    steps: list[tuple[str, Any]] = [
        ("drain", lambda: drain_bench.run(mode.name)),
        ("scaleout", lambda: scaleout_bench.scenario_scaleout(mode.name, db_url)),
    ]
    if mode.name != "smoke":
        steps.append(("notify", lambda: scaleout_bench.scenario_notify(mode.name, db_url)))
        steps.append(("uvloop", lambda: scaleout_bench.scenario_uvloop(mode.name, db_url)))
    return steps


def _pg_version(db_url: str) -> str:
    with psycopg.connect(db_url) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return str(row[0]) if row else "?"
