"""The demo (`python -m consumer_kit.demo`, from a clone also `python -m consumer_kit.demo.demo`)
exits 0 and its balances match, on the embedded PostgreSQL (pgserver; as root run as ``nobody``, see
tests/db/test_embedded_root.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from consumer_kit.db.embedded_root import private_dir_for

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("module, where", [
    ("consumer_kit.demo", "elsewhere"),
    ("consumer_kit.demo.demo", "elsewhere"),
    # as the README says: from the clone's root, where ./consumer_kit comes first on sys.path
    # (without PYTHONPATH), with consumer-kit installed editable (pip install -e '.[embedded]')
    ("consumer_kit.demo", "clone root"),
])
def test_demo_exits_0_with_matching_balances(tmp_path: Path, module: str, where: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_KIT_")}
    env["CONSUMER_KIT_EMBEDDED_DATA_DIR"] = str(tmp_path / "pgdata")
    env["COLUMNS"] = "160"
    if where == "clone root":
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = str(REPO)  # for consumer_kit.demo.demo; consumer_kit.demo is installed
    schema = f"ck_demo_{uuid.uuid4().hex[:12]}"
    try:
        result = subprocess.run(
            [sys.executable, "-m", module, "--schema", schema],
            cwd=REPO if where == "clone root" else tmp_path, env=env, capture_output=True, text=True,
            timeout=180, check=False,
        )
    finally:
        shutil.rmtree(private_dir_for(tmp_path / "pgdata"), ignore_errors=True)  # as root: its server's home
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "all checks passed" in out
    assert "outbox events relayed: 5 (expected 5) ok" in out
    for customer, cents in (("acme", "3500"), ("globex", "4700"), ("initech", "300")):
        line = next(line for line in out.splitlines() if f" {customer} " in line)
        assert line.count(cents) == 2 and "yes" in line  # expected == actual
    for outcome in ("crashed", "duplicate", "payload_conflict", "invalid_json", "failed_retained"):
        assert outcome in out
