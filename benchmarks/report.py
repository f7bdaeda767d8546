# ruff: noqa: RUF001  (en dashes and multiplication signs are meant for the report)
"""Markdown report and matplotlib charts from a results dict (see :mod:`benchmarks.runner`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common

TARGETS = {
    "ck_vs_naive": 0.85,
    "duplicate_ratio": 2.0,
    "ledger_ratio": 0.9,
    "relay_vs_raw": 0.7,
    "relay_p50_ms": 10.0,
    "relay_p99_ms": 100.0,
    "worker_rss_mb": 150.0,
}


_f = common.format_number
_ms = common.format_summary


def _verdict(value: float | None, target: float, *, higher_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "**missed**"


def write(results: dict[str, Any], out: Path) -> None:
    charts = _charts(results, out)
    lines = _markdown(results, charts)
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")


def _markdown(results: dict[str, Any], charts: list[str]) -> list[str]:
    s = results.get("scenarios", {})
    mode = results["mode"]
    lines = [
        f"# consumer-kit benchmarks ({mode['name']} run)",
        "",
        f"Started {results['started_at']}, {results.get('total_s', '?')} s in all, on "
        f"{results['machine']['cpus']} CPUs, Python {results['machine']['python']}, PostgreSQL "
        f"{results['services']['postgresql']}, RabbitMQ at {results['services']['rabbitmq']}, "
        f"Redis at {results['services']['redis']}.",
        "",
        "Figures are **median (min–max, ±half-range %)** over the rounds of this run; ratios are "
        "per round (the variants of a round ran back to back) and then summarised the same way.",
        "",
    ]
    for note in mode.get("notes", []):
        lines.append(f"- {note}")
    if mode.get("notes"):
        lines.append("")
    lines += ["## Targets", "", "| target | measured | verdict |", "|---|---|---|"]
    lines += _targets(s)
    lines.append("")

    idem = s.get("idempotency", {})
    if idem.get("by_concurrency"):
        lines += [
            "## 1. Cost of idempotency (messages/s)",
            "",
            "Same effect (insert invoice + increment customer counter + one event row) from a "
            "pre-filled quorum queue. naive = aio-pika + psycopg, write then ack, no ledger; "
            "consumer-kit = `Worker` + RabbitMQ adapter; Powertools = aio-pika + "
            "`idempotent_function` with the Redis (`CachePersistenceLayer`) store, in a thread pool.",
            "",
            "Client CPU µs per delivery: the consumer process's CPU time (all threads) from its first "
            "finished delivery to its last, over those deliveries.",
            "",
            "| concurrency | naive | consumer-kit | Powertools+Redis | ck / naive | ck / Powertools | "
            "CPU µs: naive, ck, Powertools |",
            "|---|---|---|---|---|---|---|",
        ]
        for c, e in idem["by_concurrency"].items():
            cpu = e.get("cpu_us", {})
            lines.append(
                f"| {c} | {_ms(e['naive'])} | {_ms(e['ck'])} | {_ms(e['powertools'])} | "
                f"{_ms(e['ratio_ck_naive'], 2)} | {_ms(e['ratio_ck_powertools'], 2)} | "
                f"{', '.join(_f((cpu.get(v) or {}).get('median')) for v in ('naive', 'ck', 'powertools'))} |"
            )
        errs = [err for e in idem["by_concurrency"].values() for err in e.get("errors", [])]
        if errs:
            lines += ["", "Rounds that did not finish: " + "; ".join(errs[:5])]
        lines.append("")
    dup = idem.get("duplicate") or {}
    if dup:
        lines += [
            "## 2. Duplicate path",
            "",
            f"consumer-kit at concurrency {dup['concurrency']}: the same operations sent again "
            "(every delivery finds a completed ledger row).",
            "",
            "| first execution msg/s | duplicate msg/s | duplicate / first | CPU µs per delivery: first, duplicate |",
            "|---|---|---|---|",
            f"| {_ms(dup['first_execution'])} | {_ms(dup['duplicate'])} | {_ms(dup['ratio'], 2)} | "
            f"{_f((dup.get('cpu_us', {}).get('first_execution') or {}).get('median'))}, "
            f"{_f((dup.get('cpu_us', {}).get('duplicate') or {}).get('median'))} |",
            "",
        ]
    led = s.get("ledger", {})
    if led.get("sizes"):
        lines += [
            "## 3. Ledger size",
            "",
            "consumer-kit at concurrency 8; the ledger pre-filled with completed rows by COPY "
            "(keys interleaved with the benchmark's keys; primary key rebuilt, `VACUUM ANALYZE`, "
            "`CHECKPOINT`). Each round runs an empty-ledger schema and the filled one back to back.",
            "",
            "| ledger rows | COPY + index s | empty msg/s | filled msg/s | filled / empty |",
            "|---|---|---|---|---|",
        ]
        for size, e in led["sizes"].items():
            lines.append(f"| {int(size):,} | {_f(led.get('prefill_seconds', {}).get(size), 1)} | "
                         f"{_ms(e['empty'])} | {_ms(e['filled'])} | {_ms(e.get('ratio_to_empty'), 2)} |")
        if led.get("explain_claim"):
            lines += [
                "",
                f"Claim plan at the largest size (index-bound: {led.get('index_bound')}):",
                "",
                "```",
                led["explain_claim"],
                "```",
            ]
        lines.append("")
    relay = s.get("relay", {})
    if relay:
        lines += ["## 4. Relay", ""]
        ob = relay.get("outbox_relay", {})
        if ob.get("runs"):
            lines += [
                f"Raw aio-pika publish with confirms (256 in flight), same run: "
                f"**{_f(ob.get('raw_aio_pika_confirms_per_s'))} msg/s**. Backlog of "
                f"{_f(ob.get('events'))} events; steady-state latency from COMMIT to arrival.",
                "",
                "| relays | per-key ordering | drain events/s | / raw | steady ev/s | p50 ms | p99 ms |",
                "|---|---|---|---|---|---|---|",
            ]
            raw = ob.get("raw_aio_pika_confirms_per_s") or 0
            for r in ob["runs"]:
                lines.append(
                    f"| {r['relays']} | {'on' if r['ordered'] else 'off'} | "
                    f"{_f(r['drain_events_per_s'])} | "
                    f"{_f(r['drain_events_per_s'] / raw if raw else None, 2)} | {_f(r['steady_rate'])} | "
                    f"{_f(r['latency_p50_ms'], 1)} | {_f(r['latency_p99_ms'], 1)} |"
                )
        else:
            lines.append(f"outbox-relay: {ob.get('error', 'not run')}")
        fs = relay.get("faststream_outbox", {})
        lines += ["", "faststream-outbox (PyPI) relaying the same kind of events to the same broker: "
                  + (f"**{_f(fs['drain_events_per_s'])} events/s** draining {_f(fs['events'])} "
                     f"(version {fs.get('version')})." if fs.get("drain_events_per_s")
                     else f"not measured: {fs.get('error') or fs.get('skipped')}"), ""]
    pg = s.get("pgbench", {})
    if pg.get("runs"):
        lines += [
            "## 5. Physical limit (pgbench, same transaction shape)",
            "",
            "consumer-kit shape: claim INSERT + invoice INSERT + counter upsert + outbox INSERT "
            "+ ledger UPDATE in one transaction; naive shape: the three effect statements.",
            "",
            "| shape | clients | tps |",
            "|---|---|---|",
        ]
        for r in pg["runs"].values():
            lines.append(f"| {r['shape']} | {r['clients']} | {_f(r['tps'])} |")
        on8, off8 = pg["runs"].get("ck_c8", {}).get("tps"), pg["runs"].get("ck_nonotify_c8", {}).get("tps")
        if on8 and off8:
            lines += ["", f"With the outbox's NOTIFY trigger disabled the same 8-client script runs at "
                      f"{_f(off8)} tps ({off8 / on8:.1f}×): PostgreSQL serialises the commits of "
                      "transactions that issued NOTIFY."]
        ck8 = _median(idem, "8", "ck")
        pg8 = pg["runs"].get("ck_c8", {}).get("tps")
        if ck8 and pg8:
            lines += ["", f"consumer-kit at concurrency 8 reaches {ck8 / pg8:.0%} of pgbench's "
                      f"8-client rate for the same transaction ({_f(ck8)} vs {_f(pg8)} tps)."]
        lines.append("")
    mem = s.get("memory", {})
    rmem = s.get("relay_memory", {})
    if mem or rmem:
        w = mem.get("worker", {})
        lines += [
            "## 6. Memory",
            "",
            "| process | load | peak RSS MB |",
            "|---|---|---|",
            f"| consumer-kit worker, concurrency 64 | {_f(w.get('messages'))} messages at "
            f"{_f(w.get('rate'))} msg/s | {_f(w.get('peak_rss_mb'), 1)} |",
        ]
        if rmem:
            lines.append(f"| outbox-relay (1 process) | {_f(rmem.get('events'))} events | "
                         f"{_f(rmem.get('peak_rss_mb'), 1) if 'peak_rss_mb' in rmem else rmem.get('error')} |")
        lines.append("")
    crash = s.get("crash", {})
    if crash.get("ck"):
        lines += [
            "## 7. Correctness under SIGKILL",
            "",
            f"{_f(crash['messages'])} operations at concurrency 8; the consumer process is SIGKILLed "
            f"{crash['kills']} times, each time once it has applied a random 4–12% of the operations "
            "(so deliveries are in flight), restarted, and finally left to drain.",
            "",
            "| variant | effects applied more than once | operations lost | notes |",
            "|---|---|---|---|",
            f"| consumer-kit | {crash['ck']['applied_more_than_once']} | {crash['ck']['lost']} | "
            f"{_f(crash['ck'].get('applied_before_final_run'))} applied before the last restart; "
            f"ledger states {crash['ck'].get('ledger')} |",
            f"| Powertools+Redis | {crash['powertools']['applied_more_than_once']} | "
            f"{crash['powertools']['lost']} | "
            f"{_f(crash['powertools'].get('applied_before_final_run'))} applied before the last restart; "
            f"{crash['powertools'].get('stuck_inprogress')} Redis records "
            "left INPROGRESS (no Lambda context, so no in-progress expiry: blocked for "
            "`expires_after_seconds`, 3600 s); "
            f"{crash['powertools'].get('stuck_with_effect_committed', 'n/a')} of them belong to operations "
            "whose effect did commit, so they will be applied a second time when the record expires |",
            "",
        ]
    from benchmarks import batch_bench, drain_bench, scaleout_bench

    lines += batch_bench.report_lines(s)

    lines += drain_bench.report_lines(s.get("drain") or {})
    lines += scaleout_bench.report_lines(s)
    for name, sc in s.items():
        if isinstance(sc, dict) and sc.get("error"):
            lines.append(f"Scenario {name} failed: `{sc['error']}`")
    if charts:
        lines += ["## Charts", ""] + [f"![{c}]({c})" for c in charts] + [""]
    lines += ["## Time per scenario (s)", "", ", ".join(f"{k}: {v}" for k, v in
                                                       results.get("timings_s", {}).items()), ""]
    load = results.get("load_average_1min")
    if load:
        lines += ["1-minute load average before the run and after each scenario (2 CPUs; anything "
                  "well above the benchmark's own ~2 means other work shared the machine): "
                  + ", ".join(f"{k}: {v}" for k, v in load.items()), ""]
    return lines


def _ratio(summary: dict[str, Any]) -> str:
    if summary.get("median") is None:
        return "n/a"
    return f"{summary['median']:.2f} ({summary['min']:.2f}–{summary['max']:.2f})"


def _median(idem: dict[str, Any], c: str, variant: str) -> float | None:
    e = idem.get("by_concurrency", {}).get(c)
    return e[variant]["median"] if e else None


def _targets(s: dict[str, Any]) -> list[str]:
    rows: list[str] = []
    idem = s.get("idempotency", {})
    for c in ("1", "8", "32"):
        e = idem.get("by_concurrency", {}).get(c)
        v = e["ratio_ck_naive"]["median"] if e else None
        rows.append(f"| consumer-kit ≥ 0.85 × naive at concurrency {c} | {_f(v, 2)} | "
                    f"{_verdict(v, TARGETS['ck_vs_naive'])} |")
        v = e["ratio_ck_powertools"]["median"] if e else None
        rows.append(f"| consumer-kit > 1.0 × Powertools+Redis at concurrency {c} | {_f(v, 2)} | "
                    f"{_verdict(v, 1.0)} |")
    dup = (idem.get("duplicate") or {}).get("ratio", {}).get("median")
    rows.append(f"| duplicate path ≥ 2 × first execution | {_f(dup, 2)} | {_verdict(dup, 2.0)} |")
    sizes = s.get("ledger", {}).get("sizes", {})
    if sizes:
        largest = max(sizes, key=int)
        v = (sizes[largest].get("ratio_to_empty") or {}).get("median")
        rows.append(f"| {int(largest):,}-row ledger ≥ 0.9 × empty (issue: 10,000,000) | {_f(v, 2)} | "
                    f"{_verdict(v, 0.9)} |")
    ob = s.get("relay", {}).get("outbox_relay", {})
    one = [r for r in ob.get("runs", []) if r["relays"] == 1]
    raw = ob.get("raw_aio_pika_confirms_per_s")
    if one and raw:
        best = max(r["drain_events_per_s"] for r in one) / raw
        p50 = max(r["latency_p50_ms"] for r in one)
        p99 = max(r["latency_p99_ms"] for r in one)
        rows.append(f"| relay (1) ≥ 0.7 × raw publish-with-confirms | {_f(best, 2)} | {_verdict(best, 0.7)} |")
        rows.append(f"| commit-to-publish p50 ≤ 10 ms (1 relay, worst of ordered/unordered) | {_f(p50, 1)} | "
                    f"{_verdict(p50, 10, higher_is_better=False)} |")
        rows.append(f"| commit-to-publish p99 ≤ 100 ms | {_f(p99, 1)} | "
                    f"{_verdict(p99, 100, higher_is_better=False)} |")
    else:
        rows.append("| relay targets | n/a | not measured |")
    from benchmarks import batch_bench

    rows += batch_bench.target_rows(s)
    rss = s.get("memory", {}).get("worker", {}).get("peak_rss_mb")
    rows.append(f"| worker peak RSS ≤ 150 MB at concurrency 64 | {_f(rss, 1)} | "
                f"{_verdict(rss, 150, higher_is_better=False)} |")
    crash = s.get("crash", {}).get("ck")
    if crash:
        bad = crash["applied_more_than_once"] + crash["lost"]
        rows.append(f"| consumer-kit: zero double effects and zero lost under SIGKILL | "
                    f"{crash['applied_more_than_once']} / {crash['lost']} | {'met' if bad == 0 else '**missed**'} |")
    return rows


def _charts(results: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results.get("scenarios", {})
    made: list[str] = []
    idem = s.get("idempotency", {}).get("by_concurrency", {})
    if idem:
        fig, ax = plt.subplots(figsize=(7, 4))
        cs = list(idem)
        width = 0.27
        for k, (variant, label) in enumerate(
            [("naive", "naive aio-pika+psycopg"), ("ck", "consumer-kit"), ("powertools", "Powertools+Redis")]
        ):
            med = [idem[c][variant]["median"] or 0 for c in cs]
            lo = [m - (idem[c][variant]["min"] or m) for m, c in zip(med, cs, strict=True)]
            hi = [(idem[c][variant]["max"] or m) - m for m, c in zip(med, cs, strict=True)]
            ax.bar([i + (k - 1) * width for i in range(len(cs))], med, width, yerr=[lo, hi],
                   label=label, capsize=3)
        ax.set_xticks(range(len(cs)), [f"concurrency {c}" for c in cs])
        ax.set_ylabel("messages/s (median, min–max)")
        ax.set_title("1. Cost of idempotency")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "idempotency.png", dpi=110)
        plt.close(fig)
        made.append("idempotency.png")
    sizes = s.get("ledger", {}).get("sizes", {})
    dup = s.get("idempotency", {}).get("duplicate") or {}
    if sizes or dup:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        if dup:
            vals = [dup["first_execution"]["median"] or 0, dup["duplicate"]["median"] or 0]
            axes[0].bar(["first execution", "all duplicates"], vals, color=["tab:orange", "tab:green"])
            axes[0].set_ylabel("messages/s")
            axes[0].set_title("2. Duplicate path (c=8)")
        if sizes:
            keys = list(sizes)
            xs = range(len(keys))
            axes[1].bar([x - 0.2 for x in xs], [sizes[k]["empty"]["median"] or 0 for k in keys], 0.4,
                        label="empty ledger (same round)")
            axes[1].bar([x + 0.2 for x in xs], [sizes[k]["filled"]["median"] or 0 for k in keys], 0.4,
                        label="pre-filled ledger")
            axes[1].set_xticks(list(xs), [f"{int(k):,} rows" for k in keys])
            axes[1].set_ylabel("messages/s")
            axes[1].set_title("3. Ledger size (c=8)")
            axes[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "duplicate_and_ledger.png", dpi=110)
        plt.close(fig)
        made.append("duplicate_and_ledger.png")
    pg = s.get("pgbench", {}).get("runs", {})
    if pg and idem:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        labels, vals = [], []
        for r in pg.values():
            labels.append(f"pgbench {r['shape']}\n{r['clients']} client(s)")
            vals.append(r["tps"] or 0)
        for c in ("1", "8"):
            if c in idem:
                labels.append(f"consumer-kit\nc={c}")
                vals.append(idem[c]["ck"]["median"] or 0)
        ax.bar(labels, vals, color=["tab:gray"] * len(pg) + ["tab:orange"] * (len(labels) - len(pg)))
        ax.set_ylabel("transactions/s")
        ax.set_title("5. consumer-kit vs PostgreSQL's commit rate")
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        fig.savefig(out / "pgbench.png", dpi=110)
        plt.close(fig)
        made.append("pgbench.png")
    ob = s.get("relay", {}).get("outbox_relay", {})
    if ob.get("runs"):
        fig, ax = plt.subplots(figsize=(7, 3.6))
        labels = [f"{r['relays']} relay{'s' if r['relays'] > 1 else ''}\n{'ordered' if r['ordered'] else 'unordered'}"
                  for r in ob["runs"]]
        vals = [r["drain_events_per_s"] for r in ob["runs"]]
        labels.append("raw aio-pika\nconfirms")
        vals.append(ob.get("raw_aio_pika_confirms_per_s") or 0)
        fs = s.get("relay", {}).get("faststream_outbox", {})
        if fs.get("drain_events_per_s"):
            labels.append("faststream-\noutbox")
            vals.append(fs["drain_events_per_s"])
        ax.bar(labels, vals)
        ax.set_ylabel("events/s")
        ax.set_title("4. Relay drain rate")
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        fig.savefig(out / "relay.png", dpi=110)
        plt.close(fig)
        made.append("relay.png")
    return made
