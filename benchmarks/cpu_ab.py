"""Client CPU per delivery, A/B between checkouts in one run:

``python -m benchmarks.cpu_ab --tree new=. --tree old=/path/to/other/worktree [--variants ck naive dup]
[--batch 50]``

Each tree runs ``benchmarks/consumers.py`` with its own ``.venv/bin/python`` and its own working
directory (an editable install maps ``consumer_kit.adapters`` to that tree's ``adapters/``). Every
round runs every (tree, variant) pair back to back, order alternating between rounds, each on a
fresh schema and queue; the figure is the consumer process's CPU time (``time.process_time``, all
threads) from its first finished delivery to its last, divided by the deliveries in between: a
loaded machine changes it far less than it changes msg/s. ``dup`` drains the same messages twice
on one schema and reports the second drain (every delivery a duplicate). The batch variants
(``ck_batch``, ``naive_batch``, ``ck_nats_batch``, ``faststream_nats_batch``) take batches of
``--batch`` (``--batch-wait`` 0.1 s); the NATS ones drain a JetStream stream instead of a queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import declare_and_fill, delete_queues, drop_schema, message_body, new_name


def _drain(
    tree: Path, variant: str, ids: range, schema: str, concurrency: int, extra_env: dict[str, str],
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    queue = new_name("ckbq")
    nats = "nats" in variant
    try:
        if nats:
            from benchmarks.nats_consumers import fill_stream

            asyncio.run(fill_stream(queue, (message_body(i) for i in ids)))
        else:
            asyncio.run(declare_and_fill(queue, (message_body(i) for i in ids)))
        env = dict(os.environ, PYTHONPATH=str(tree), **extra_env)
        proc = subprocess.run(
            [
                str(tree / ".venv/bin/python"),
                "-m",
                "benchmarks.consumers",
                variant,
                "--queue",
                queue,
                "--schema",
                schema,
                "--concurrency",
                str(concurrency),
                "--expect",
                str(len(ids)),
                "--timeout",
                "300",
                *extra,
            ],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{tree} {variant}: rc={proc.returncode} {proc.stderr[-1500:]}")
        return json.loads(lines[-1])  # type: ignore[no-any-return]
    finally:
        if nats:
            from benchmarks.nats_consumers import delete_stream

            asyncio.run(delete_stream(queue))
        else:
            asyncio.run(delete_queues(queue))


def one(
    tree: Path, variant: str, messages: int, concurrency: int, extra_env: dict[str, str], batch: int = 10
) -> dict[str, Any]:
    """One drain's result (``cpu_us_per_delivery``, ``rate``; a batch variant with batches of
    ``batch``)."""
    db = common.ensure_database()
    schema = new_name()
    common.create_schema(db, schema)
    ids = range(1, messages + 1)
    extra = ("--batch", str(batch), "--batch-wait", "0.1") if variant.endswith("batch") else ()
    try:
        res = _drain(tree, "ck" if variant == "dup" else variant, ids, schema, concurrency, extra_env, extra)
        if variant == "dup":
            res = _drain(tree, "ck", ids, schema, concurrency, extra_env)
        if res.get("cpu_us_per_delivery") is None:  # a tree with the older harness
            res["cpu_us_per_delivery"] = res["cpu_seconds"] / max(res["processed"] - 1, 1) * 1e6
        return res
    finally:
        drop_schema(db, schema)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH")
    parser.add_argument(
        "--env", action="append", default=[], help="LABEL:VAR=VALUE, for that tree's runs only"
    )
    parser.add_argument("--variants", nargs="+", default=["ck", "naive"])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=10, help="batch variants: the batch size")
    args = parser.parse_args()
    trees = [(label, Path(path).resolve()) for label, _, path in (t.partition("=") for t in args.tree)]
    envs: dict[str, dict[str, str]] = {}
    for spec in args.env:
        label, _, assignment = spec.partition(":")
        var, _, value = assignment.partition("=")
        envs.setdefault(label, {})[var] = value
    pairs = [(label, tree, v) for v in args.variants for label, tree in trees]
    results: dict[tuple[str, str], list[float]] = {(label, v): [] for label, _, v in pairs}
    for r in range(args.rounds):
        for label, tree, v in pairs if r % 2 == 0 else list(reversed(pairs)):
            res = one(tree, v, args.messages, args.concurrency, envs.get(label, {}), args.batch)
            us = res["cpu_us_per_delivery"]
            results[label, v].append(us)
            print(f"round {r} {label:>10} {v:>6}: {us:7.1f} us/delivery, {res.get('rate') or 0:7.0f} msg/s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print(
        f"\nmedian CPU us per delivery, {args.messages} messages, concurrency {args.concurrency}, "
        f"{args.rounds} rounds"
    )
    for (label, v), values in results.items():
        print(f"{label:>10} {v:>6}: {statistics.median(values):7.1f}  ({min(values):.1f}-{max(values):.1f})")
    first = trees[0][0]
    for label, _ in trees[1:]:  # paired per round: the load changes less within a round
        for v in args.variants:
            ratios = [a / b for a, b in zip(results[label, v], results[first, v], strict=True)]
            print(
                f"{label}/{first} {v:>6}: median {statistics.median(ratios):.3f}  "
                f"({min(ratios):.3f}-{max(ratios):.3f})"
            )


if __name__ == "__main__":
    main()
