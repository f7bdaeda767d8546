"""A release a team can pin: one version source (pyproject.toml), printed by both commands and
``consumer_kit.__version__``, a CHANGELOG whose newest release is that version, and an install
page that says how to build, check and vendor the wheel (the build itself: test_packaging.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

import consumer_kit

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_installed_version_is_pyprojects() -> None:
    assert version("consumer-kit") == consumer_kit.__version__ == VERSION


@pytest.mark.parametrize("program, module", [("consumer-kit", "consumer_kit"),
                                             ("outbox-relay", "consumer_kit.outbox_relay.cli")])
def test_each_command_prints_the_version(program: str, module: str) -> None:
    result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                            timeout=60, check=False)
    assert (result.returncode, result.stdout) == (0, f"{program} {VERSION}\n"), result.stderr


def test_no_other_file_writes_a_version_of_its_own() -> None:
    sources = [path for folder in ("consumer_kit", "adapters", "outbox_relay", "examples/invoices")
               for path in (ROOT / folder).rglob("*.py")]
    assert [str(p) for p in sources if re.search(r"^__version__\s*=\s*['\"]", p.read_text(), re.M)] == []
    assert "dynamic" not in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_changelogs_newest_release_is_this_version() -> None:
    releases = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases[0] == "Unreleased"  # where the next release's changes are written
    assert releases[1] == VERSION, releases


def test_the_install_page_says_how_to_build_check_and_vendor_the_wheel() -> None:
    page = (ROOT / "docs" / "how-to" / "install.md").read_text()
    for needed in ("pip install build twine", "python -m build --sdist --wheel", "twine check --strict",
                   "Vendor the wheel", f"consumer_kit-{VERSION}-py3-none-any.whl", "--find-links"):
        assert needed in page, needed
