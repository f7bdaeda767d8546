# ruff: noqa: RUF001  (multiplication signs and en dashes are meant for the report)
"""The batch path (docs/how-to/batches.md): ``batch`` on RabbitMQ and ``nats_batch`` on NATS
JetStream (``python -m benchmarks run --only batch nats_batch``).

* ``batch``: consumer-kit's batch path (``ck_batch``) against the naive one-per-transaction
  consumer (``naive``) and the naive batch consumer (``naive_batch``, same batch size), at batch
  sizes 10 and 50 and concurrency 8 and 32. The naive batch consumer must be a fair peer: at
  every setting it is at least as fast as the one-per-transaction consumer (the report checks it).
* ``nats_batch``: FastStream's batch subscriber on a JetStream pull consumer
  (``faststream_nats_batch``) against consumer-kit's batch path with the NATS adapter
  (``ck_nats_batch``), same batch sizes, concurrency 8. FastStream batches on NATS JetStream pull
  consumers, Kafka and Redis, not on RabbitMQ, so it is a peer on this broker only.

The variants of a round run back to back, order alternating between rounds; every ratio is per
round. Every row also states the client CPU per delivery (the consumer process's CPU time from its
first finished delivery to its last, over those deliveries): on a shared 2-core machine the
steadiest figure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import common
from benchmarks.common import effect_counts, message_body, new_name, paired_ratio, summarize

logger = logging.getLogger("benchmarks.batch")

BATCH_VARIANTS = ("naive", "naive_batch", "ck_batch")
NATS_VARIANTS = ("faststream_nats_batch", "ck_nats_batch")
BATCH_SIZES = (10, 50)
BATCH_CONCURRENCIES = (8, 32)
NATS_CONCURRENCIES = (8,)
BATCH_WAIT = 0.1  # seconds, every batch peer: under a backlog a batch of 50 needs it to fill

Measure = Callable[..., dict[str, Any]]


def scenario_batch(mode: Any, db_url: str, measure: Measure) -> dict[str, Any]:
    """RabbitMQ: ``ck_batch`` against ``naive`` and ``naive_batch`` (module docstring)."""
    smoke = mode.name == "smoke"
    return _scenario(
        mode, db_url, measure, BATCH_VARIANTS, (8,) if smoke else BATCH_CONCURRENCIES,
        (10,) if smoke else BATCH_SIZES, {"ck_batch_naive": ("ck_batch", "naive"),
                                          "ck_batch_naive_batch": ("ck_batch", "naive_batch"),
                                          "naive_batch_naive": ("naive_batch", "naive")},
    )


def scenario_nats_batch(mode: Any, db_url: str, run_consumer: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """NATS JetStream: ``ck_nats_batch`` against ``faststream_nats_batch`` (module docstring);
    ``run_consumer(variant, queue, schema, concurrency, expect, extra)`` runs one drain."""

    def measure(variant: str, ids: range, concurrency: int, *, schema: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        from benchmarks.nats_consumers import delete_stream, fill_stream

        queue = new_name("ckbn")
        try:
            asyncio.run(fill_stream(queue, (message_body(i) for i in ids)))
            return run_consumer(variant, queue, schema, concurrency, len(ids), extra)
        finally:
            asyncio.run(delete_stream(queue))

    smoke = mode.name == "smoke"
    return _scenario(
        mode, db_url, measure, NATS_VARIANTS, (8,) if smoke else NATS_CONCURRENCIES,
        (10,) if smoke else BATCH_SIZES, {"ck_nats_batch_faststream": ("ck_nats_batch", "faststream_nats_batch")},
    )


def _scenario(
    mode: Any, db_url: str, measure: Measure, variants: Sequence[str], concurrencies: Sequence[int],
    sizes: Sequence[int], ratios: dict[str, tuple[str, str]],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in concurrencies:
        for size in sizes:
            rates: dict[str, list[float]] = {v: [] for v in variants}
            cpus: dict[str, list[float]] = {v: [] for v in variants}
            errors: list[str] = []
            for r in range(mode.rounds):
                for variant in list(variants) if r % 2 == 0 else list(reversed(variants)):
                    schema = new_name()
                    common.create_schema(db_url, schema)
                    try:
                        batching = variant != "naive"
                        extra = ("--batch", str(size), "--batch-wait", str(BATCH_WAIT)) if batching else ()
                        res = measure(variant, range(1, mode.messages + 1), c, schema=schema, extra=extra)
                        if res.get("rate"):
                            rates[variant].append(res["rate"])
                            cpus[variant].append(res["cpu_us_per_delivery"])
                        else:
                            errors.append(f"{variant} c={c} b={size} round {r}: {res.get('error', '')[:200]}")
                        counts = effect_counts(db_url, schema)
                        if counts["more_than_once"] or (res.get("rate") and counts["once"] != mode.messages):
                            errors.append(f"{variant} c={c} b={size} round {r}: effects {counts}")
                    finally:
                        common.drop_schema(db_url, schema)
                logger.info("batch c=%s b=%s round %s: %s", c, size, r, {v: rates[v][-1:] for v in variants})
            entry: dict[str, Any] = {v: summarize(rates[v]) for v in variants}
            entry["cpu_us"] = {v: summarize(cpus[v]) for v in variants}
            for name, (a, b) in ratios.items():
                n = min(len(rates[a]), len(rates[b]))
                entry[f"ratio_{name}"] = paired_ratio(rates[a][:n], rates[b][:n])
                entry[f"cpu_ratio_{name}"] = paired_ratio(cpus[a][:n], cpus[b][:n])
            entry["errors"] = errors
            out[f"c{c}_b{size}"] = entry
    return out


# -- report ------------------------------------------------------------------------------------


def report_lines(s: dict[str, Any]) -> list[str]:
    """The ``batch`` and ``nats_batch`` sections of REPORT.md."""
    return _rabbitmq_lines(s.get("batch") or {}) + _nats_lines(s.get("nats_batch") or {})


def target_rows(s: dict[str, Any]) -> list[str]:
    """The batch rows of the report's target table."""
    rows: list[str] = []
    for key, e in (s.get("batch") or {}).items():
        if not isinstance(e, dict) or "ck_batch" not in e:
            continue
        v = e["ratio_ck_batch_naive"]["median"]
        rows.append(f"| consumer-kit batches ≥ 2 × naive one-per-transaction ({key}) | {_num(v)} | {_verdict(v, 2.0)} |")
        v = e["ratio_ck_batch_naive_batch"]["median"]
        rows.append(f"| consumer-kit batches ≥ 0.85 × naive batch ({key}) | {_num(v)} | {_verdict(v, 0.85)} |")
        v = e["cpu_ratio_ck_batch_naive_batch"]["median"]
        rows.append(f"| consumer-kit batch CPU per message ≤ 1.3 × naive batch's ({key}) | {_num(v)} | "
                    f"{_verdict(v, 1.3, higher_is_better=False)} |")
        v = e["ratio_naive_batch_naive"]["median"]
        rows.append(f"| the naive batch peer ≥ 1 × naive one-per-transaction ({key}: a fair peer) | {_num(v)} | "
                    f"{_verdict(v, 1.0)} |")
    return rows


def _rabbitmq_lines(batch: dict[str, Any]) -> list[str]:
    rows = [k for k, v in batch.items() if isinstance(v, dict) and "ck_batch" in v]
    if not rows:
        return []
    lines = [
        "## Batches on RabbitMQ (msg/s; client CPU µs per delivery)",
        "",
        "naive = one message per transaction; naive batch = aio-pika + psycopg, one channel per "
        "task with prefetch = 2 × batch size, a batch taken when full or `batch_wait` after its first "
        "message, its effect as one `unnest` statement per table in one transaction, one multiple "
        "ack; consumer-kit batches = `Worker` on the batch path with `examples/invoices/batches.py` "
        "(`handle_batch`, the same `unnest` statements, events through `ctx.publish`).",
        "",
        "| concurrency, batch size | naive | naive batch | consumer-kit batches | ck batches / naive | "
        "ck batches / naive batch | naive batch / naive | CPU µs: naive, naive batch, ck batches | "
        "CPU ck / naive batch | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in rows:
        e = batch[key]
        c, b = key.removeprefix("c").split("_b")
        cpu = e.get("cpu_us", {})
        lines.append(
            f"| {c}, {b} | {_num(e['naive']['median'], 0)} | {_num(e['naive_batch']['median'], 0)} | "
            f"{_num(e['ck_batch']['median'], 0)} | {_ratio(e['ratio_ck_batch_naive'])} | "
            f"{_ratio(e['ratio_ck_batch_naive_batch'])} | {_ratio(e.get('ratio_naive_batch_naive', {}))} | "
            f"{', '.join(_num(cpu.get(v, {}).get('median'), 0) for v in BATCH_VARIANTS)} | "
            f"{_ratio(e.get('cpu_ratio_ck_batch_naive_batch', {}))} | {len(e.get('errors', []))} |"
        )
    return [*lines, ""]


def _nats_lines(batch: dict[str, Any]) -> list[str]:
    rows = [k for k, v in batch.items() if isinstance(v, dict) and "ck_nats_batch" in v]
    if not rows:
        return []
    lines = [
        "## Batches on NATS JetStream (msg/s; client CPU µs per delivery)",
        "",
        "FastStream = FastStream's batch subscriber on a JetStream pull consumer (`PullSub(batch_size, "
        "timeout, batch=True)`, one subscriber per unit of concurrency on one durable consumer), the "
        "naive batch consumer's statements in one transaction, FastStream's own ack; consumer-kit "
        "batches = `Worker` on the batch path with the NATS adapter and `examples/invoices/batches.py`.",
        "",
        "| concurrency, batch size | FastStream batch | consumer-kit batches | ck / FastStream | "
        "CPU µs: FastStream, ck | CPU ck / FastStream | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in rows:
        e = batch[key]
        c, b = key.removeprefix("c").split("_b")
        cpu = e.get("cpu_us", {})
        lines.append(
            f"| {c}, {b} | {_num(e['faststream_nats_batch']['median'], 0)} | {_num(e['ck_nats_batch']['median'], 0)} | "
            f"{_ratio(e['ratio_ck_nats_batch_faststream'])} | "
            f"{', '.join(_num(cpu.get(v, {}).get('median'), 0) for v in NATS_VARIANTS)} | "
            f"{_ratio(e.get('cpu_ratio_ck_nats_batch_faststream', {}))} | {len(e.get('errors', []))} |"
        )
    return [*lines, ""]


def _num(value: float | None, digits: int = 2) -> str:
    return common.format_number(value, digits)


def _ratio(summary: dict[str, Any]) -> str:
    if not summary or summary.get("median") is None:
        return "n/a"
    return f"{summary['median']:.2f} ({summary['min']:.2f}–{summary['max']:.2f})"


def _verdict(value: float | None, target: float, *, higher_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= target if higher_is_better else value <= target) else "**missed**"
