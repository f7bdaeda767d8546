"""The floors of docs/explanation/architecture.md hold in the code: every import (type-only ones
included) points to the same floor or one below, no module imports another in a circle, no module
is over 400 lines, and the code cites no file outside the repository.

The imports are read from the source by their installed names (pyproject's package-dir), the way
``consumer_kit._checkout`` lays the tree out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from consumer_kit._checkout import package_dirs

ROOT = Path(__file__).resolve().parents[2]

FLOORS: list[tuple[str, ...]] = [  # lowest first: the table of docs/explanation/architecture.md
    ("consumer_kit.model", "consumer_kit.errors", "consumer_kit.resilience", "consumer_kit._checkout"),
    ("consumer_kit.codec",),
    ("consumer_kit.settings",),
    ("consumer_kit.telemetry",),
    ("consumer_kit.db",),
    ("consumer_kit.identity", "consumer_kit.tenancy", "consumer_kit.versions", "consumer_kit.effects"),
    ("consumer_kit.ledger", "consumer_kit.outbox"),
    ("consumer_kit.broker",),
    ("consumer_kit.handler", "consumer_kit.context", "consumer_kit.app"),
    ("consumer_kit.pipeline",),
    ("consumer_kit.http", "consumer_kit.ops", "consumer_kit.worker", "consumer_kit.testing"),
    ("consumer_kit.cli", "consumer_kit.console_web", "consumer_kit.__main__"),
    ("consumer_kit.adapters", "consumer_kit.outbox_relay"),
    ("consumer_kit.demo",),
]
FACE = "consumer_kit"  # the package's face re-exports the handler author's names: the cli's floor


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for name, folder in package_dirs(ROOT).items():  # no mapped folder lies inside another
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


MODULES = _modules()


def _imports(module: str, path: Path) -> set[str]:
    """The consumer_kit modules ``module`` imports, wherever the import stands (``if
    TYPE_CHECKING:`` and function bodies included). ``from pkg import sub`` names ``pkg.sub`` only."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES]
            targets = subs if len(subs) == len(node.names) else [target, *subs]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def floor(module: str) -> int:
    if module == FACE:
        return next(i for i, names in enumerate(FLOORS) if "consumer_kit.cli" in names)
    best = max(((i, len(prefix)) for i, names in enumerate(FLOORS) for prefix in names
                if module == prefix or module.startswith(prefix + ".")), key=lambda found: found[1])
    return best[0]


def test_every_module_stands_on_a_floor() -> None:
    assert len(MODULES) > 200
    for module in MODULES:
        assert floor(module) >= 0, module


def test_every_import_points_to_the_same_floor_or_below() -> None:
    upwards = [f"{module} (floor {floor(module)}) -> {target} (floor {floor(target)})"
               for module, targets in GRAPH.items() for target in targets if floor(target) > floor(module)]
    assert upwards == []


def test_only_the_demo_and_the_user_facing_floors_import_the_package_face() -> None:
    """``from consumer_kit import ...`` runs the face, which imports nearly everything: inside the
    core it would tie every floor to every other."""
    importers = sorted(module for module, targets in GRAPH.items() if FACE in targets)
    assert all(floor(module) >= floor("consumer_kit.adapters") for module in importers), importers


def test_no_module_imports_another_in_a_circle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in GRAPH[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert circles == []


def test_no_module_is_over_400_lines() -> None:
    long = {module for module, path in MODULES.items() if len(path.read_text().splitlines()) > 400}
    assert long == set(), sorted(long)


def test_the_code_cites_no_file_outside_the_repository_and_no_issue_number() -> None:
    """Comments and docstrings cite the project's own docs pages (docs/...)."""
    pattern = re.compile(r"DESIGN\.md|SERVICES\.md|\b[Ii]ssues? \d+\b")
    sources = [*MODULES.values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
               ROOT / ".ci" / "run"]
    offenders = [f"{path.relative_to(ROOT)}:{n}" for path in sources if "__pycache__" not in path.parts
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if pattern.search(line) and path != Path(__file__)]
    assert offenders == []


def test_every_background_task_is_supervised_or_a_documented_one_shot() -> None:
    """A task started bare may be collected mid-way or outlive its owner: outside the two kinds of
    docs/explanation/architecture.md ("Background tasks and backoff"), every ``create_task`` names
    who waits for it, in a ``one-shot:`` comment on the line above."""
    kinds = {ROOT / "consumer_kit" / "resilience" / "supervised.py", ROOT / "consumer_kit" / "resilience" / "one_shots.py"}
    bare = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            if "create_task(" in line and path not in kinds and "one-shot:" not in lines[n - 1]:
                bare.append(f"{path.relative_to(ROOT)}:{n + 1}")
    assert bare == []
