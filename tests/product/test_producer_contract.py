"""The producer contract page (docs/how-to/producer-contract.md) is true: its example, a producer's
own test, passes against the contract ``consumer-kit asyncapi`` writes for the invoices example,
and fails against a contract that calls no field volatile."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "producer_contract" / "test_commands_match_the_contract.py"


def producer_tests(folder: Path) -> subprocess.CompletedProcess[str]:
    shutil.copy(EXAMPLE, folder / EXAMPLE.name)  # the producer's repository: the test and the contract
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:consumer_kit",
                           EXAMPLE.name], cwd=folder, capture_output=True, text=True, timeout=120, check=False)


def test_the_pages_example_passes_against_the_written_contract(tmp_path: Path) -> None:
    written = subprocess.run([sys.executable, "-m", "consumer_kit", "asyncapi", "consumer_kit.demo.app:app",
                              "--out", str(tmp_path / "asyncapi.json")], capture_output=True, text=True,
                             timeout=60, check=False, cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    result = producer_tests(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_the_example_fails_when_the_contract_forbids_the_change(tmp_path: Path) -> None:
    from consumer_kit.demo.app import app
    from consumer_kit.ops.asyncapi import document

    contract = document(app)
    contract["components"]["messages"]["invoices.commands.CreateInvoice"]["x-consumer-kit-fingerprint"]["volatile"] = []
    (tmp_path / "asyncapi.json").write_text(json.dumps(contract))
    result = producer_tests(tmp_path)
    assert result.returncode == 1 and "1 failed, 1 passed" in result.stdout, result.stdout
