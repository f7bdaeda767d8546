# ruff: noqa: RUF001, RUF002  (multiplication signs and en dashes are meant for the report)
"""Scale-out on one machine: several consumer processes on one queue, the outbox NOTIFY switch
with several writer processes, and uvloop against asyncio's own loop.

Scenarios (``python -m benchmarks run --only scaleout notify uvloop``, or this module's CLI):

* ``scaleout``: for P in ``--processes`` (default 1, 2, 4), P consumer-kit processes and then P
  naive processes (order alternating per round), each at concurrency 8, drain one pre-filled queue;
  beside them pgbench with P × 8 clients running each variant's transaction shape (the scripts of
  the ``pgbench`` scenario): the ceiling PostgreSQL sets on this machine for that shape.
* ``notify``: P consumer-kit processes (P in 2, 4) with the outbox NOTIFY on and off
  (``CONSUMER_KIT_OUTBOX_NOTIFY=false``, migration 103), back to back; and pgbench's ceiling for
  the consumer-kit shape with the session setting on and off at 8, 16 and 32 clients.
* ``uvloop``: one consumer-kit process at concurrency 8 (and 32) on asyncio's loop and on uvloop,
  back to back.

A multi-process run: every process is started with ``--wait-go``, imports and prints ``ready``;
when all are ready they get SIGUSR1 together and start; the parent waits until the effect table
holds every operation, then stops them with SIGTERM. Each process reports its finished deliveries
per 0.1 s of wall clock; the run's rate is the operations over the span from the first finished
delivery of any process to the last (``rate``), and ``rate_all_active`` counts only the span in
which every process had started and none had finished yet. Ratios are per round (variants of a
round ran back to back), summarised as median (min–max) over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from benchmarks import common
from benchmarks.common import declare_and_fill, delete_queues, message_body, new_name, paired_ratio, summarize

logger = logging.getLogger("benchmarks.scaleout")
ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = 8

# messages per run, rounds, process counts, pgbench seconds, NOTIFY process counts
SIZES: dict[str, dict[str, Any]] = {
    "smoke": {"messages": 300, "rounds": 1, "processes": [2], "pgbench_seconds": 1,
              "notify_processes": [2], "notify_pgbench_clients": [8], "uvloop_concurrency": [8]},
    "quick": {"messages": 2500, "rounds": 3, "processes": [1, 2, 4], "pgbench_seconds": 3,
              "notify_processes": [4], "notify_pgbench_clients": [8, 32], "uvloop_concurrency": [8]},
    "full": {"messages": 10000, "rounds": 5, "processes": [1, 2, 4], "pgbench_seconds": 10,
             "notify_processes": [2, 4], "notify_pgbench_clients": [8, 16, 32], "uvloop_concurrency": [8, 32]},
}


# -- one multi-process run ----------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _invoices(db_url: str, schema: str) -> int:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
            sql.Identifier(schema, "invoices"))).fetchone()
    return int(row[0]) if row else 0


def run_processes(variant: str, processes: int, messages: int, db_url: str, *,
                  concurrency: int = CONCURRENCY, extra: list[str] | None = None,
                  timeout: float | None = None) -> dict[str, Any]:
    """Fill a fresh queue with ``messages`` operations; start ``processes`` consumers of
    ``variant`` on it together; return the combined rate (see the module docstring)."""
    schema, queue = new_name(), new_name("ckbq")
    common.create_schema(db_url, schema)
    timeout = timeout or max(120.0, messages / 50.0)
    procs: list[subprocess.Popen[str]] = []
    try:
        asyncio.run(declare_and_fill(queue, (message_body(i) for i in range(1, messages + 1))))
        cmd = [sys.executable, "-m", "benchmarks.consumers", variant, "--queue", queue, "--schema", schema,
               "--concurrency", str(concurrency), "--expect", "0", "--timeout", str(timeout + 30),
               "--wait-go", *(extra or [])]
        for _ in range(processes):
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        for p in procs:  # each prints "ready" once imported
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"{variant} process did not start: {line!r} {p.stderr.read()[-500:] if p.stderr else ''}")
        for p in procs:
            p.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        done = 0
        while time.monotonic() < deadline:
            done = _invoices(db_url, schema)
            if done >= messages:
                break
            time.sleep(0.2)
        time.sleep(0.3)  # the last acks
        for p in procs:
            p.send_signal(signal.SIGTERM)
        reports = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if not lines:
                raise RuntimeError(f"{variant} process rc={p.returncode}: {err[-800:]}")
            reports.append(json.loads(lines[-1]))
        return combine(reports, messages, done, processes)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        common.drop_schema(db_url, schema)
        asyncio.run(delete_queues(queue))


def combine(reports: list[dict[str, Any]], messages: int, applied: int, processes: int) -> dict[str, Any]:
    """One rate from the processes' timelines (see the module docstring)."""
    firsts = [r["first_at"] for r in reports if r.get("first_at")]
    lasts = [r["last_at"] for r in reports if r.get("last_at")]
    processed = sum(r["processed"] for r in reports)
    out: dict[str, Any] = {"processes": processes, "messages": messages, "applied": applied,
                           "processed": processed, "per_process": [r["processed"] for r in reports],
                           "cpu_seconds": round(sum(r.get("cpu_seconds", 0.0) for r in reports), 2)}
    if applied < messages or not firsts:
        out.update(rate=None, rate_all_active=None, error=f"only {applied} of {messages} applied")
        return out
    span = max(lasts) - min(firsts)
    out["rate"] = (processed - 1) / span if span > 0 else None
    start, end = max(firsts), min(lasts)
    if end - start >= 0.5 and len(firsts) == processes:
        lo, hi = int(start * 10) + 1, int(end * 10)  # whole 0.1 s slots inside the span
        inside = sum(n for r in reports for slot, n in r["timeline"].items() if lo <= int(slot) < hi)
        out["rate_all_active"] = inside / ((hi - lo) / 10) if hi > lo else None
    else:
        out["rate_all_active"] = None
    # CPU from each process's first finished delivery to its last, over those deliveries
    out["cpu_us_per_delivery"] = round(out["cpu_seconds"] / (processed - len(reports)) * 1e6) \
        if processed > len(reports) else None
    return out


# -- pgbench ceilings ---------------------------------------------------------------------------


def pgbench_ceilings(db_url: str, clients: list[int], seconds: int, *, notify_off: bool = True) -> dict[str, Any]:
    """pgbench tps of the consumer-kit and naive transaction shapes (the ``pgbench`` scenario's
    scripts) at each client count; with ``notify_off`` also the consumer-kit shape with the
    sessions' outbox NOTIFY switched off (``-c consumer_kit.outbox_notify=off``)."""
    from benchmarks.pgbench_scripts import PGBENCH_CK, PGBENCH_NAIVE

    schema = new_name()
    common.create_schema(db_url, schema)
    out: dict[str, Any] = {"seconds": seconds, "runs": {}}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scripts = {"ck": PGBENCH_CK, "naive": PGBENCH_NAIVE}
            for name, text in scripts.items():
                (Path(tmp) / f"{name}.sql").write_text(text)
            for c in clients:
                shapes = [("ck", None), ("naive", None)]
                if notify_off:
                    shapes.append(("ck", "-c consumer_kit.outbox_notify=off"))
                for shape, options in shapes:
                    tps = common.pgbench(db_url, schema, Path(tmp) / f"{shape}.sql", c, seconds, options)
                    key = f"{shape}{'_nonotify' if options else ''}_c{c}"
                    out["runs"][key] = {"shape": shape, "notify": options is None, "clients": c, "tps": tps}
    finally:
        common.drop_schema(db_url, schema)
    return out


# -- scenarios ----------------------------------------------------------------------------------


def _rounds(label_runs: dict[str, tuple[str, list[str]]], processes: int, messages: int, rounds: int,
            db_url: str, concurrency: int = CONCURRENCY) -> dict[str, Any]:
    """``rounds`` rounds of every labelled (variant, extra args) run, order alternating per round."""
    rates: dict[str, list[float]] = {k: [] for k in label_runs}
    active: dict[str, list[float]] = {k: [] for k in label_runs}
    cpu: dict[str, list[float]] = {k: [] for k in label_runs}
    errors: list[str] = []
    labels = list(label_runs)
    for r in range(rounds):
        order = labels if r % 2 == 0 else list(reversed(labels))
        got: dict[str, dict[str, Any]] = {}
        for label in order:
            variant, extra = label_runs[label]
            try:
                got[label] = run_processes(variant, processes, messages, db_url, concurrency=concurrency,
                                           extra=extra)
            except Exception as exc:  # noqa: BLE001 - reported, the round is dropped
                got[label] = {"rate": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
        if all(g.get("rate") for g in got.values()):  # keep only whole rounds: ratios stay paired
            for label, g in got.items():
                rates[label].append(g["rate"])
                if g.get("rate_all_active"):
                    active[label].append(g["rate_all_active"])
                if g.get("cpu_us_per_delivery"):
                    cpu[label].append(g["cpu_us_per_delivery"])
        else:
            errors += [f"{label} round {r}: {g.get('error')}" for label, g in got.items() if not g.get("rate")]
        logger.info("P=%s round %s: %s", processes, r, {k: round(v["rate"] or 0) for k, v in got.items()})
    out: dict[str, Any] = {k: {"rate": summarize(rates[k]), "rate_all_active": summarize(active[k]),
                               "cpu_us_per_delivery": summarize(cpu[k])} for k in labels}
    out["errors"] = errors
    out["_rates"] = rates
    return out


def scenario_scaleout(mode: str, db_url: str) -> dict[str, Any]:
    """P consumer-kit processes vs P naive processes, and pgbench's ceiling at P × 8 clients."""
    cfg = SIZES[mode]
    out: dict[str, Any] = {"concurrency_per_process": CONCURRENCY, "messages": cfg["messages"],
                           "rounds": cfg["rounds"], "by_processes": {}}
    for p in cfg["processes"]:
        entry = _rounds({"ck": ("ck", []), "naive": ("naive", [])}, p, cfg["messages"], cfg["rounds"], db_url)
        rates = entry.pop("_rates")
        entry["ratio_ck_naive"] = paired_ratio(rates["ck"], rates["naive"])
        out["by_processes"][str(p)] = entry
    base = out["by_processes"].get(str(cfg["processes"][0]), {})
    for entry in out["by_processes"].values():
        for v in ("ck", "naive"):
            b, m = base.get(v, {}).get("rate", {}).get("median"), entry[v]["rate"]["median"]
            entry[v]["speedup_vs_1"] = round(m / b, 2) if b and m else None
    out["pgbench"] = pgbench_ceilings(db_url, [p * CONCURRENCY for p in cfg["processes"]],
                                      cfg["pgbench_seconds"], notify_off=False)
    return out


def scenario_notify(mode: str, db_url: str) -> dict[str, Any]:
    """P consumer-kit processes with the outbox NOTIFY on and off, back to back; pgbench beside."""
    cfg = SIZES[mode]
    out: dict[str, Any] = {"concurrency_per_process": CONCURRENCY, "messages": cfg["messages"],
                           "rounds": cfg["rounds"], "by_processes": {}}
    for p in cfg["notify_processes"]:
        entry = _rounds({"notify_on": ("ck", []), "notify_off": ("ck", ["--no-outbox-notify"])},
                        p, cfg["messages"], cfg["rounds"], db_url)
        rates = entry.pop("_rates")
        entry["ratio_off_on"] = paired_ratio(rates["notify_off"], rates["notify_on"])
        out["by_processes"][str(p)] = entry
    out["pgbench"] = pgbench_ceilings(db_url, cfg["notify_pgbench_clients"], cfg["pgbench_seconds"],
                                      notify_off=True)
    return out


def scenario_uvloop(mode: str, db_url: str) -> dict[str, Any]:
    """One consumer-kit process on asyncio's loop and on uvloop, back to back."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {"skipped": "uvloop is not installed: pip install -e '.[bench]'"}
    cfg = SIZES[mode]
    out: dict[str, Any] = {"messages": cfg["messages"], "rounds": cfg["rounds"], "by_concurrency": {}}
    for c in cfg["uvloop_concurrency"]:
        entry = _rounds({"asyncio": ("ck", ["--loop", "asyncio"]), "uvloop": ("ck", ["--loop", "uvloop"])},
                        1, cfg["messages"], cfg["rounds"], db_url, concurrency=c)
        rates = entry.pop("_rates")
        entry["ratio_uvloop_asyncio"] = paired_ratio(rates["uvloop"], rates["asyncio"])
        out["by_concurrency"][str(c)] = entry
    return out


# -- report --------------------------------------------------------------------------------------


def _ms(summary: dict[str, Any] | None, digits: int = 0) -> str:
    fmt = common.format_summary

    return fmt(summary, digits)


def report_lines(s: dict[str, Any]) -> list[str]:
    """Markdown sections of scenarios ``scaleout``, ``notify`` and ``uvloop``."""
    lines: list[str] = []
    sc = s.get("scaleout") or {}
    if sc.get("by_processes"):
        pg = sc.get("pgbench", {}).get("runs", {})
        lines += [
            "## 9. Scale-out: processes on one queue",
            "",
            f"P processes at concurrency {sc['concurrency_per_process']} each drain one queue of "
            f"{sc['messages']:,} operations (started together); msg/s from the first finished delivery "
            "to the last (all-active: only while every process ran). pgbench: the same transaction "
            f"shape with P × {sc['concurrency_per_process']} clients, {sc.get('pgbench', {}).get('seconds')} s.",
            "",
            "| processes | consumer-kit msg/s | naive msg/s | ck / naive | ck all-active | naive all-active "
            "| ck speed-up | naive speed-up | pgbench ck shape tps | pgbench naive shape tps "
            "| CPU µs/delivery ck / naive |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p, e in sc["by_processes"].items():
            c = int(p) * sc["concurrency_per_process"]
            lines.append(
                f"| {p} | {_ms(e['ck']['rate'])} | {_ms(e['naive']['rate'])} | {_ms(e['ratio_ck_naive'], 2)} | "
                f"{_ms(e['ck']['rate_all_active'])} | {_ms(e['naive']['rate_all_active'])} | "
                f"{e['ck'].get('speedup_vs_1')} | {e['naive'].get('speedup_vs_1')} | "
                f"{_fmt(pg.get(f'ck_c{c}', {}).get('tps'))} | {_fmt(pg.get(f'naive_c{c}', {}).get('tps'))} | "
                f"{_fmt(e['ck']['cpu_us_per_delivery'].get('median'))} / "
                f"{_fmt(e['naive']['cpu_us_per_delivery'].get('median'))} |"
            )
        errs = [x for e in sc["by_processes"].values() for x in e.get("errors", [])]
        if errs:
            lines += ["", "Rounds dropped: " + "; ".join(errs[:5])]
        lines.append("")
    nt = s.get("notify") or {}
    if nt.get("by_processes"):
        pg = nt.get("pgbench", {}).get("runs", {})
        lines += [
            "## 10. Outbox NOTIFY on and off with several writer processes",
            "",
            f"P consumer-kit processes at concurrency {nt['concurrency_per_process']}, "
            f"{nt['messages']:,} operations, each writing one outbox row; NOTIFY off = "
            "`CONSUMER_KIT_OUTBOX_NOTIFY=false` (sessions opened with `-c consumer_kit.outbox_notify=off`).",
            "",
            "| processes | NOTIFY on msg/s | NOTIFY off msg/s | off / on |",
            "|---|---|---|---|",
        ]
        for p, e in nt["by_processes"].items():
            lines.append(f"| {p} | {_ms(e['notify_on']['rate'])} | {_ms(e['notify_off']['rate'])} | "
                         f"{_ms(e['ratio_off_on'], 2)} |")
        lines += ["", "pgbench, consumer-kit transaction shape (one run each):", "",
                  "| clients | NOTIFY on tps | NOTIFY off tps | off / on |", "|---|---|---|---|"]
        for r in pg.values():
            if r["shape"] == "ck" and r["notify"]:
                off = pg.get(f"ck_nonotify_c{r['clients']}", {}).get("tps")
                lines.append(f"| {r['clients']} | {_fmt(r['tps'])} | {_fmt(off)} | "
                             f"{_fmt(off / r['tps'] if off and r['tps'] else None, 2)} |")
        lines.append("")
    uv = s.get("uvloop") or {}
    if uv.get("by_concurrency"):
        lines += [
            "## 11. uvloop",
            "",
            f"One consumer-kit process, {uv['messages']:,} operations, asyncio's loop and uvloop back to back.",
            "",
            "| concurrency | asyncio msg/s | uvloop msg/s | uvloop / asyncio | CPU µs/delivery asyncio / uvloop |",
            "|---|---|---|---|---|",
        ]
        for c, e in uv["by_concurrency"].items():
            lines.append(f"| {c} | {_ms(e['asyncio']['rate'])} | {_ms(e['uvloop']['rate'])} | "
                         f"{_ms(e['ratio_uvloop_asyncio'], 2)} | "
                         f"{_fmt(e['asyncio']['cpu_us_per_delivery'].get('median'))} / "
                         f"{_fmt(e['uvloop']['cpu_us_per_delivery'].get('median'))} |")
        lines.append("")
    return lines


def _fmt(v: Any, digits: int = 0) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.{digits}f}"


SCENARIOS = {"scaleout": scenario_scaleout, "notify": scenario_notify, "uvloop": scenario_uvloop}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaleout_bench")
    parser.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    parser.add_argument("--mode", choices=sorted(SIZES), default="quick")
    parser.add_argument("--processes", type=lambda v: [int(x) for x in v.split(",")], default=None,
                        help="comma-separated process counts, e.g. 1,2,4")
    parser.add_argument("--messages", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = SIZES[args.mode]
    if args.processes:
        cfg["processes"] = args.processes
    if args.messages:
        cfg["messages"] = args.messages
    if args.rounds:
        cfg["rounds"] = args.rounds
    db_url = common.ensure_database()
    results: dict[str, Any] = {"mode": args.mode, "settings": cfg, "cpus": os.cpu_count(),
                               "load_average_1min": {"before": round(os.getloadavg()[0], 2)}}
    for name in args.scenarios:
        t0 = time.perf_counter()
        results[name] = SCENARIOS[name](args.mode, db_url)
        results.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        results["load_average_1min"][name] = round(os.getloadavg()[0], 2)
    text = json.dumps(results, indent=2, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".md").write_text("\n".join(report_lines(results)) + "\n")
        print(f"written to {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
