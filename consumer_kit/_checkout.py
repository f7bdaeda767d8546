"""consumer_kit imported from a source checkout: the folders that install under its name.

The repository keeps ``adapters/``, ``outbox_relay/`` and ``examples/invoices/`` at its top level and
the wheel installs them as ``consumer_kit.adapters``, ``consumer_kit.outbox_relay`` and
``consumer_kit.demo``: pyproject.toml's ``[tool.setuptools.package-dir]`` is the one place that says
so (docs/explanation/architecture.md, "One name for each file"). Everything else reads it from there:

* :func:`map_folders` (called by ``consumer_kit/__init__.py``): when ``consumer_kit`` itself was
  imported from a checkout (the clone's root on ``sys.path``: an editable install, or any install
  while the current directory is the clone's root), the mapped names are served from their folders,
  so that every name resolves as it does in a wheel, from any directory;
* :func:`lay_out`: the installed tree as symbolic links,
  for the tools that read source files by their import names (mypy in ``.ci/run``, mkdocstrings in
  the docs build).

In an installed wheel there is no pyproject.toml beside the package and nothing here does anything.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
"""The folder that holds this package: a clone's root when imported from a checkout."""


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Installed package name -> folder, as ``root/pyproject.toml`` maps them (``consumer_kit``
    itself included); ``{}`` when ``root`` is not a consumer-kit checkout."""
    pyproject = root / "pyproject.toml"
    try:
        config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    if config.get("project", {}).get("name") != "consumer-kit":
        return {}
    mapping: dict[str, str] = config.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    return {name: root / folder for name, folder in mapping.items()}


class _MappedFolders(importlib.abc.MetaPathFinder):
    """Finds ``consumer_kit.adapters`` (and the other mapped names) in their folders; what lies
    below them is found the usual way, through the package's ``__path__``."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


def map_folders() -> None:
    """Serve the mapped names from this checkout's folders (nothing in an installed wheel).
    Idempotent."""
    folders = {name: folder for name, folder in package_dirs().items() if name != "consumer_kit"}
    if not folders or any(isinstance(finder, _MappedFolders) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _MappedFolders(folders))


def lay_out(dest: Path, root: Path = ROOT) -> Path:
    """Lay out ``dest/consumer_kit`` as the wheel installs it, as symbolic links to the files of the
    checkout at ``root`` (never copies: a tool always reads the code as it is). Idempotent: stale
    links are replaced. Returns ``dest``.

    Raises:
        FileNotFoundError: ``root`` is not a consumer-kit checkout.
    """
    dirs = package_dirs(root)
    if not dirs:
        raise FileNotFoundError(f"{root} is not a consumer-kit checkout (no pyproject.toml of consumer-kit)")
    mapped = {folder.resolve() for folder in dirs.values()}
    for installed, folder in dirs.items():
        target = dest / installed.replace(".", "/")
        target.mkdir(parents=True, exist_ok=True)
        for entry in sorted(folder.iterdir()):
            if entry.name == "__pycache__" or (entry.is_dir() and entry.resolve() in mapped):
                continue  # a mapped folder is laid out under its own name
            link = target / entry.name
            if link.is_symlink() and link.resolve() == entry.resolve():
                continue
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return dest
