"""Where a consumer's time goes: ``python -m benchmarks profile [--variant ck] [--messages N]``.

Fills a queue, drains it with the variant's consumer process under ``py-spy record`` (raw
collapsed stacks, 250 Hz) and prints/writes two tables: the share of samples whose deepest
project frame (consumer_kit/, adapters/, benchmarks/consumers.py) is a given source line, and the
inclusive share of selected library functions (psycopg round trips, transactions, aiormq).
"""

from __future__ import annotations

import asyncio
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks import common
from benchmarks.common import (
    declare_and_fill,
    delete_queues,
    delete_redis_keys,
    drop_schema,
    message_body,
    new_name,
)

ROOT = Path(__file__).resolve().parents[1]
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_PROJECT = ("consumer_kit/", "adapters/", "benchmarks/consumers.py")
_LIBRARY = (
    "AsyncConnection.wait", "AsyncCursor.execute", "AsyncConnection.transaction",
    "AsyncTransaction.__aenter__", "AsyncTransaction.__aexit__", "BaseCursor._convert_query",
    "Composed.as_bytes", "AsyncConnectionPool.connection", "Connection.__reader",
    "Connection.__writer", "Runtime._decode", "fingerprint", "record",
)


def summarize(raw: Path, top: int = 25) -> str:
    total = 0
    deepest: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        owner = "(event loop, aiormq, asyncio: no project frame)"
        for frame in reversed(frames):
            if any(p in frame for p in _PROJECT):
                owner = frame.replace(str(ROOT) + "/", "")
                break
        deepest[owner] += n
        names = set()
        for frame in frames:
            m = _FRAME.match(frame)
            if m:
                names.add(m["func"])
        for name in _LIBRARY:
            if name in names:
                inclusive[name] += n
    out = [f"samples: {total}", "", "share  deepest project frame (source line)"]
    out += [f"{v / total:6.1%} {k}" for k, v in deepest.most_common(top)]
    out += ["", "share  inclusive, selected functions"]
    out += [f"{v / total:6.1%} {k}" for k, v in inclusive.most_common()]
    return "\n".join(out)


def run(variant: str, messages: int, concurrency: int, out: Path, batch: int = 10) -> str:
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    db = common.ensure_database()
    schema, queue = new_name(), new_name("ckbq")
    common.create_schema(db, schema)
    raw = out / f"profile_{variant}.txt"
    nats = "nats" in variant
    try:
        bodies = (message_body(i) for i in range(1, messages + 1))
        if nats:
            from benchmarks.nats_consumers import fill_stream

            asyncio.run(fill_stream(queue, bodies))
        else:
            asyncio.run(declare_and_fill(queue, bodies))
        subprocess.run(
            [pyspy, "record", "-r", "250", "-f", "raw", "-o", str(raw), "--", sys.executable, "-m",
             "benchmarks.consumers", variant, "--queue", queue, "--schema", schema,
             "--concurrency", str(concurrency), "--expect", str(messages),
             *(("--batch", str(batch)) if variant.endswith("batch") else ())],
            cwd=ROOT, check=True, capture_output=True,
        )
    finally:
        drop_schema(db, schema)
        if nats:
            from benchmarks.nats_consumers import delete_stream

            asyncio.run(delete_stream(queue))
        else:
            asyncio.run(delete_queues(queue))
        if variant == "powertools":
            delete_redis_keys(schema)
    text = summarize(raw)
    (out / f"profile_{variant}_summary.txt").write_text(text + "\n")
    return text
