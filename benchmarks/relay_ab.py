"""Relay CPU per 1,000 events, A/B between two versions of the code in one run.

``python -m benchmarks.relay_ab [--base REV] [--events 10000] [--rounds 3] [--unordered|--ordered]
[--profile DIR]``

The machine is shared, so events/s say little; the relay process's own CPU time does. Each
version (``--base``, a git revision, default ``main``; and the working tree, ``head``) is laid out
as it installs (``consumer_kit/`` with ``adapters/`` and ``outbox_relay/`` inside) in a temporary
folder, next to a copy of the working tree's ``benchmarks/``. Each round then, for every version
in turn (order alternating between rounds): inserts ``--events`` pending rows into one outbox
(schema ``ckb_relayab_*`` in ``ck_bench``, vhost of its own, see :mod:`benchmarks.drain_bench`)
and drains them with ``python -m benchmarks.drain_bench relay`` run from that version's folder,
which reports the relay's CPU (user + system, ``getrusage``) per 1,000 rows marked published.
Prints each round's figures and the per-round ratio head / base, then their medians.
``--profile DIR``: the head's drain of the last round runs under ``py-spy record`` (raw collapsed
stacks) and the summary of :func:`benchmarks.profile.summarize` is printed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import common, drain_bench

ROOT = Path(__file__).resolve().parents[1]
_FOLDERS = ("consumer_kit", "adapters", "outbox_relay")


def lay_out(rev: str | None, into: Path) -> Path:
    """``into`` holding ``consumer_kit`` of ``rev`` (``None``: the working tree) as installed,
    plus the working tree's ``benchmarks`` and ``examples``; returns ``into``."""
    src = into / "src"
    if rev is None:
        for name in _FOLDERS:
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        data = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, *_FOLDERS], capture_output=True, check=True
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(src, filter="data")
    package = into / "consumer_kit"
    shutil.move(src / "consumer_kit", package)
    shutil.move(src / "adapters", package / "adapters")
    shutil.move(src / "outbox_relay", package / "outbox_relay")
    skip = shutil.ignore_patterns("__pycache__", "results", "latest")
    for name in ("benchmarks", "examples"):  # the drain child's own imports
        shutil.copytree(ROOT / name, into / name, ignore=skip)
    shutil.rmtree(src)
    return into


def drain_from(
    tree: Path, db_url: str, amqp_url: str, schema: str, *, n: int, ordered: bool, profile: Path | None = None
) -> dict[str, Any]:
    """Drain ``n`` pending rows with the relay of ``tree``: the child's JSON result."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.drain_bench",
        "relay",
        "--schema",
        schema,
        "--expect",
        str(n),
        "--database-url",
        db_url,
        "--broker-url",
        amqp_url,
        "--ordered" if ordered else "--unordered",
        "--timeout",
        str(drain_bench.drain_timeout(n)),
    ]
    if profile is not None:
        pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        cmd = [pyspy, "record", "--format", "raw", "--rate", "250", "-o", str(profile), "--", *cmd]
    # cwd first on sys.path (python -m): this tree's consumer_kit wins over the editable install
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, cwd=tree, env=env, timeout=drain_bench.drain_timeout(n) + 60
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"rc={proc.returncode}: {proc.stderr[-800:]}"}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.relay_ab", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--base", default="main", help="git revision to compare the working tree with")
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ordered", dest="ordered", action="store_true", default=False)
    parser.add_argument("--unordered", dest="ordered", action="store_false")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the head's last drain into DIR")
    args = parser.parse_args(argv)
    db_url = common.ensure_database()
    schema = common.new_name("ckb_relayab")
    amqp_url, vhost = drain_bench.open_vhost()
    figures: dict[str, list[float]] = {"base": [], "head": []}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ckb_relayab_") as tmp:
        trees = {"base": lay_out(args.base, Path(tmp) / "base"), "head": lay_out(None, Path(tmp) / "head")}
        try:
            import asyncio

            asyncio.run(drain_bench._declare_sink(amqp_url))
            drain_bench.prepare(db_url, schema, 0)
            for r in range(args.rounds):
                order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
                got: dict[str, float] = {}
                for name in order:
                    with psycopg.connect(db_url, autocommit=True) as conn:
                        drain_bench._insert(conn, schema, args.events, keyed=args.ordered, published=False)
                        conn.execute("CHECKPOINT")
                    profile = None
                    if args.profile is not None and name == "head" and r == args.rounds - 1:
                        args.profile.mkdir(parents=True, exist_ok=True)
                        profile = args.profile / "relay.raw"
                    res = drain_from(
                        trees[name],
                        db_url,
                        amqp_url,
                        schema,
                        n=args.events,
                        ordered=args.ordered,
                        profile=profile,
                    )
                    cpu = res.get("relay_cpu_ms_per_1000_rows")
                    print(
                        f"round {r} {name}: cpu ms/1k rows {cpu}, rows/s {res.get('rows_per_s')}"
                        f"{'  ' + res['error'] if 'error' in res else ''}",
                        flush=True,
                    )
                    if cpu:
                        got[name] = float(cpu)
                        figures[name].append(float(cpu))
                    with psycopg.connect(db_url, autocommit=True) as conn:
                        conn.execute(
                            f'UPDATE "{schema}".outbox SET published_at = now() WHERE published_at IS NULL'
                        )
                        conn.execute(f'VACUUM "{schema}".outbox')
                if len(got) == 2:
                    ratios.append(got["head"] / got["base"])
        finally:
            common.drop_schema(db_url, schema)
            drain_bench.close_vhost(vhost)
    summary = {k: statistics.median(v) if v else None for k, v in figures.items()}
    print(
        json.dumps(
            {
                "base": args.base,
                "events": args.events,
                "ordered": args.ordered,
                "cpu_ms_per_1k": figures,
                "median": summary,
                "head_over_base_per_round": [round(x, 3) for x in ratios],
                "head_over_base_median": round(statistics.median(ratios), 3) if ratios else None,
            }
        )
    )
    if args.profile is not None and (args.profile / "relay.raw").exists():
        from benchmarks.profile import summarize

        print(summarize(args.profile / "relay.raw", top=30))
    return 0


if __name__ == "__main__":
    sys.exit(main())
