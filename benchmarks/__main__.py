"""``python -m benchmarks run [--quick | --smoke] [--out DIR] [--only SCENARIO ...]``
``python -m benchmarks profile [--variant ck] [--messages N] [--concurrency C]``

Writes ``results.json``, ``REPORT.md`` and PNG charts to ``--out`` (default
``benchmarks/results/<mode>``). Needs PostgreSQL on 127.0.0.1:5432, RabbitMQ on 127.0.0.1:5672 and
Redis on 127.0.0.1:6379, and the ``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from benchmarks import report, runner

SCENARIOS = ["idempotency", "ledger", "pgbench", "memory", "crash", "relay", "relay_memory",
             "drain", "scaleout", "notify", "uvloop", "batch", "nats_batch"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the scenarios and write the report")
    size = run.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="under 10 minutes on 2 cores")
    size.add_argument("--smoke", action="store_true", help="a few hundred messages (CI)")
    run.add_argument("--out", type=Path, default=None)
    run.add_argument("--only", nargs="+", choices=SCENARIOS, default=None)
    run.add_argument("-v", "--verbose", action="store_true")
    prof = sub.add_parser("profile", help="py-spy profile of one consumer draining a queue")
    prof.add_argument("--variant", choices=["ck", "naive", "powertools", "ck_batch", "naive_batch",
                                                     "ck_nats_batch", "faststream_nats_batch"], default="ck")
    prof.add_argument("--batch", type=int, default=10, help="batch variants: the batch size")
    prof.add_argument("--messages", type=int, default=8000)
    prof.add_argument("--concurrency", type=int, default=8)
    prof.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    if args.command == "profile":
        from benchmarks import profile

        out = args.out or Path(__file__).resolve().parent / "results" / "profile"
        out.mkdir(parents=True, exist_ok=True)
        print(profile.run(args.variant, args.messages, args.concurrency, out, args.batch))
        return 0

    logging.basicConfig(
        level=logging.INFO if args.verbose or not args.smoke else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    out = args.out or Path(__file__).resolve().parent / "results" / mode
    out.mkdir(parents=True, exist_ok=True)
    results = runner.run_all(mode, set(args.only) if args.only else None)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    report.write(results, out)
    print(f"results: {out / 'results.json'}\nreport:  {out / 'REPORT.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
