"""One distribution, no generic import names (issue 21).

The repository's folders ``adapters/``, ``outbox_relay/`` and ``examples/invoices/`` install as
``consumer_kit.adapters``, ``consumer_kit.outbox_relay`` and ``consumer_kit.demo`` (pyproject's
``[tool.setuptools] packages`` and ``package-dir``). These tests keep the package list equal to the
folders, keep every import on the installed names, and build the real wheel and sdist to check
what they carry: the wheel must be able to sit beside PyPI's ``adapters`` package.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = SETUPTOOLS["package-dir"]
MAPPED_FOLDERS = {folder for name, folder in PACKAGE_DIR.items() if name != "consumer_kit"}
SKIP_DIRS = {".venv", ".ci-venv", "build", "dist", "__pycache__", ".git", "node_modules"}
GENERIC = ("adapters", "outbox_relay", "consumer_kit.demo")  # folder names never imported as such


def _folders_to_packages() -> set[str]:
    """Every folder with an ``__init__.py`` under a package-dir root, as its installed name."""
    found: set[str] = set()
    for name, folder in PACKAGE_DIR.items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root)
            if SKIP_DIRS.intersection(relative.parts):
                continue
            # a folder mapped on its own (consumer_kit.adapters) is not also part of consumer_kit
            if any((ROOT / other) == init.parent or (ROOT / other) in init.parent.parents
                   for other in MAPPED_FOLDERS if other != folder and (ROOT / other) != root):
                continue
            found.add(".".join((name, *relative.parts)))
    return found


def _sources() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts)]


def test_the_package_list_is_the_folders_holding_init_py() -> None:
    assert sorted(SETUPTOOLS["packages"]) == sorted(_folders_to_packages())


def test_every_installed_package_sits_under_consumer_kit() -> None:
    assert all(p == "consumer_kit" or p.startswith("consumer_kit.") for p in SETUPTOOLS["packages"])


def _imported_names(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module))
    return names


def test_no_source_imports_a_folder_by_its_repository_name() -> None:
    """``import adapters`` would work in a clone and break in the wheel (or pick PyPI's
    ``adapters``); inside the mapped folders imports of their own tree are relative."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in _sources()
        for line, name in _imported_names(path)
        if name.split(".")[0] in ("adapters", "outbox_relay")
        or (name.startswith("consumer_kit.demo") and path.parent == ROOT / "examples" / "invoices")
    ]
    assert offenders == []


def test_the_user_project_imports_nothing_from_the_repository() -> None:
    project = ROOT / "examples" / "user_project"
    own = {p.stem for p in project.rglob("*.py")}
    for path in project.rglob("*.py"):
        for line, name in _imported_names(path):
            top = name.split(".")[0]
            assert top not in ("examples", "tests", "benchmarks", *GENERIC), f"{path}:{line}: {name}"
            assert top in own or top == "consumer_kit" or top in sys.stdlib_module_names \
                or top in ("pydantic", "pytest"), f"{path}:{line}: {name}"


def test_the_user_project_passes_with_warnings_as_errors() -> None:
    """The kit's pytest plugin in a project of its own: no marker, no asyncio_mode, and no
    pytest-asyncio deprecation warning (``-W error`` turns one into a failure)."""
    if os.geteuid() == 0 and not os.environ.get("CONSUMER_KIT_TEST_DATABASE_URL"):
        pytest.skip("as root the kit needs CONSUMER_KIT_TEST_DATABASE_URL (the embedded database refuses)")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"],
        cwd=ROOT / "examples" / "user_project", capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout and "warning" not in result.stdout.lower()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist and the wheel, built from this tree with ``python -m build`` (isolation off:
    the build backend is already installed, and the machine may have no index)."""
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


@pytest.mark.slow
def test_the_wheel_holds_only_consumer_kit_and_its_dist_info(built: dict[str, Path]) -> None:
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = wheel.namelist()
    tops = {name.split("/")[0] for name in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"consumer_kit"}
    assert [t.startswith("consumer_kit-") for t in dist_info] == [True]
    for module in ("consumer_kit/adapters/rabbitmq/__init__.py", "consumer_kit/outbox_relay/relay.py",
                   "consumer_kit/demo/__main__.py", "consumer_kit/demo/app.py", "consumer_kit/py.typed"):
        assert module in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@pytest.mark.slow
def test_the_sdist_ships_the_user_project(built: dict[str, Path]) -> None:
    with tarfile.open(built["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for path in ("pyproject.toml", "examples/user_project/pyproject.toml", "examples/user_project/shipments.py",
                 "examples/user_project/tests/test_shipments.py", "adapters/rabbitmq/__init__.py"):
        assert path in names
    assert not [n for n in names if "__pycache__" in n]


@pytest.mark.slow
def test_twine_check_strict_passes(built: dict[str, Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(built["wheel"]), str(built["sdist"])],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
