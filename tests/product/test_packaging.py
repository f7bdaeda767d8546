"""One distribution, no generic import names, one name for each file.

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


def _data_folders() -> set[str]:
    """The folders of data files (templates, static files) that ship as packages of their own, each
    with its package-data line, so that setuptools builds them without a warning."""
    found = set()
    for name in SETUPTOOLS["package-data"]:
        parent, _, leaf = name.rpartition(".")
        folder = ROOT / PACKAGE_DIR.get(parent, parent.replace(".", "/")) / leaf
        if parent and folder.is_dir() and not (folder / "__init__.py").exists():
            found.add(name)
    return found


def test_the_package_list_is_the_folders_holding_init_py_and_the_data_folders() -> None:
    assert _data_folders() == {"consumer_kit.console_web.static", "consumer_kit.console_web.templates"}
    assert sorted(SETUPTOOLS["packages"]) == sorted(_folders_to_packages() | _data_folders())


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
        or name.split(".")[:2] == ["examples", "invoices"]  # the demo is consumer_kit.demo everywhere
        or (name.startswith("consumer_kit.demo") and path.parent == ROOT / "examples" / "invoices")
    ]
    assert offenders == []


def test_docs_and_scripts_name_the_demo_by_its_installed_name() -> None:
    texts = [ROOT / "README.md", ROOT / "docker-compose.yml", ROOT / ".ci" / "run", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "examples").rglob("*.md"), *(ROOT / "deploy").rglob("*")]
    offenders = [str(path.relative_to(ROOT)) for path in texts
                 if path.is_file() and "examples.invoices" in path.read_text(errors="replace")]
    assert offenders == []


_WITHOUT_INSTALL_FINDERS = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__.lower()]; "
    "import consumer_kit.adapters.memory as m, consumer_kit.outbox_relay.relay as r, consumer_kit.demo.app as d; "
    "print(m.__file__, r.__file__, d.__file__, sep='\\n')"
)


def test_a_checkout_resolves_every_installed_name_by_itself() -> None:
    """From the clone's root ``consumer_kit`` is the source folder whatever is installed (a wheel,
    an editable install, or nothing): the names pyproject maps must resolve from it alone, as in
    the wheel. Run with every install-time finder removed (setuptools' editable finder)."""
    result = subprocess.run([sys.executable, "-c", _WITHOUT_INSTALL_FINDERS], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(ROOT / "adapters" / "memory.py"), str(ROOT / "outbox_relay" / "relay.py"),
                                     str(ROOT / "examples" / "invoices" / "app.py")]


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
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # a warning of its own
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600, check=False, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (out / "build.log").write_text(result.stdout + result.stderr)
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz")), "log": out / "build.log"}


@pytest.mark.slow
def test_the_build_prints_no_warning(built: dict[str, Path]) -> None:
    log = built["log"].read_text()
    assert "would be ignored" not in log and "warning" not in log.lower(), log[-3000:]


@pytest.mark.slow
def test_the_wheel_holds_only_consumer_kit_and_its_dist_info(built: dict[str, Path]) -> None:
    with zipfile.ZipFile(built["wheel"]) as wheel:
        names = wheel.namelist()
    tops = {name.split("/")[0] for name in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"consumer_kit"}
    assert [t.startswith("consumer_kit-") for t in dist_info] == [True]
    for module in ("consumer_kit/adapters/rabbitmq/__init__.py", "consumer_kit/outbox_relay/relay.py",
                   "consumer_kit/demo/__main__.py", "consumer_kit/demo/app.py", "consumer_kit/py.typed",
                   "consumer_kit/console_web/templates/base.html", "consumer_kit/console_web/static/htmx.min.js"):
        assert module in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@pytest.mark.slow
def test_the_sdist_ships_the_user_project(built: dict[str, Path]) -> None:
    with tarfile.open(built["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for path in ("pyproject.toml", "examples/user_project/pyproject.toml", "examples/user_project/shipments.py",
                 "examples/user_project/tests/test_shipments.py", "adapters/rabbitmq/__init__.py",
                 "CHANGELOG.md"):
        assert path in names
    assert not [n for n in names if "__pycache__" in n]


@pytest.mark.slow
def test_twine_check_strict_passes(built: dict[str, Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(built["wheel"]), str(built["sdist"])],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
