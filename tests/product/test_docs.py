"""The documentation site: generated reference pages cover the code, commands shown exist, the
README stays a README, and (with the docs extra installed) ``mkdocs build --strict`` passes with
the adapters' API pages rendered from the installed package names."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main

from consumer_kit.adapters.servicebus.config import ServiceBusSettings
from consumer_kit.cli.main import cli
from consumer_kit.outbox_relay.cli import app as relay_app
from consumer_kit.outbox_relay.settings import OutboxSettings, RelaySettings
from consumer_kit.settings import DatabaseSettings, Settings
from consumer_kit.telemetry.metrics import CATALOGUE

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _load_hook() -> Any:
    spec = importlib.util.spec_from_file_location("docs_reference_hook", DOCS / "hooks" / "reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = _load_hook()


def test_the_settings_page_names_every_variable_of_every_settings_class() -> None:
    page = hook.settings_markdown()
    for model in (DatabaseSettings, Settings, OutboxSettings, RelaySettings, ServiceBusSettings):
        prefix = model.model_config["env_prefix"]
        for name in model.model_fields:
            assert f"`{prefix}{name.upper()}`" in page, f"{prefix}{name.upper()} missing from the settings reference"
    assert "`CONSUMER_KIT_ALONE_MARKER_TTL`" in page  # the one the README's hand-made table had missed


def command_paths(command: Any, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    paths = [path]
    if hasattr(command, "list_commands"):
        ctx = command.context_class(command, info_name=path[-1])
        for name in command.list_commands(ctx):
            paths += command_paths(command.get_command(ctx, name), (*path, name))
    return paths


def test_the_cli_page_has_every_command_and_option() -> None:
    page = hook.cli_markdown()
    for name, app in (("consumer-kit", cli), ("outbox-relay", relay_app)):
        root = typer.main.get_command(app)
        for path in command_paths(root, (name,)):
            assert f"`{' '.join(path)}`" in page, f"{' '.join(path)} missing from the CLI reference"
        for option in (p for p in root.params if p.param_type_name == "option"):
            assert f"`{option.opts[0]}`" in page


def test_the_metrics_page_lists_the_catalogue() -> None:
    page = hook.metrics_markdown()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(CATALOGUE)
    for spec, row in zip(CATALOGUE, rows, strict=True):
        assert row.startswith(f"| `{spec.name}`<br>Prometheus: ") and all(f"`{n}`" in row for n in spec.prometheus_names)


def test_each_reference_page_asks_for_its_generated_part_and_unknown_parts_fail() -> None:
    for page, part in (("settings", "settings"), ("cli", "cli"), ("metrics", "metrics")):
        assert f"<!-- generated: {part} -->" in (DOCS / "reference" / f"{page}.md").read_text()
    assert "CONSUMER_KIT_LOCK_TIMEOUT" in hook.render_markers("# s\n\n<!-- generated: settings -->\n")
    with pytest.raises(ValueError, match=r"x\.md: unknown generated part 'setings'"):
        hook.render_markers("<!-- generated: setings -->", "x.md")


def test_the_source_mirror_has_the_installed_layout(tmp_path: Path) -> None:
    mirror = hook.build_source_mirror(ROOT, tmp_path)
    assert (mirror / "consumer_kit" / "adapters" / "rabbitmq" / "__init__.py").resolve() == ROOT / "adapters" / "rabbitmq" / "__init__.py"
    assert (mirror / "consumer_kit" / "outbox_relay" / "relay.py").resolve() == ROOT / "outbox_relay" / "relay.py"
    assert (mirror / "consumer_kit" / "ledger").resolve() == ROOT / "consumer_kit" / "ledger"
    assert hook.build_source_mirror(ROOT, tmp_path) == mirror  # idempotent


# -- the README ----------------------------------------------------------------------------------------

README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_readme_and_its_local_links_exist() -> None:
    assert len(README.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to missing {target}"


def shown_commands(text: str) -> list[list[str]]:
    """``consumer-kit ...`` and ``outbox-relay ...`` lines of the page's bash blocks."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(("consumer-kit ", "outbox-relay")):
                commands.append(shlex.split(line))
    return commands


PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_a_page_shows_exists_with_its_options(page: Path) -> None:
    roots = {"consumer-kit": typer.main.get_command(cli), "outbox-relay": typer.main.get_command(relay_app)}
    for argv in shown_commands(page.read_text()):
        command, ctx = roots[argv[0]], None
        ctx = command.context_class(command, info_name=argv[0])
        words = argv[1:]
        while words and hasattr(command, "list_commands") and not words[0].startswith("-"):
            sub = command.get_command(ctx, words[0])
            assert sub is not None, f"{page.name}: {' '.join(argv)}: no command {words[0]!r}"
            command, words = sub, words[1:]
            ctx = command.context_class(command, info_name=argv[0], parent=ctx)
        known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        for word in words:
            if word.startswith("--"):
                assert word.split("=")[0] in known, f"{page.name}: {' '.join(argv)}: no option {word}"


def test_a_misspelt_command_or_option_on_a_page_fails(tmp_path: Path) -> None:
    assert shown_commands("```bash\nconsumer-kit dlq redrive q --all  # x\n```") == [["consumer-kit", "dlq", "redrive", "q", "--all"]]
    for wrong, says in (("consumer-kit ledgr list", "no command 'ledgr'"), ("consumer-kit prune --dry-rn", "no option --dry-rn"),
                        ("outbox-relay requeu", "no command 'requeu'")):
        page = tmp_path / "page.md"
        page.write_text(f"```bash\n{wrong}\n```\n")
        with pytest.raises(AssertionError, match=says):
            test_every_command_a_page_shows_exists_with_its_options(page)


# -- the site ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_site_builds_strictly_with_the_adapters_api(tmp_path: Path) -> None:
    pytest.importorskip("mkdocstrings_handlers.python", reason="pip install -e '.[docs]'")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    adapters = (tmp_path / "reference" / "adapters" / "index.html").read_text()
    for broker in ("rabbitmq", "sqs", "servicebus"):
        assert f'id="consumer_kit.adapters.{broker}"' in adapters
    assert "CONSUMER_KIT_RELAY_BATCH_SIZE" in (tmp_path / "reference" / "settings" / "index.html").read_text()
    assert "consumer-kit dlq redrive" in (tmp_path / "reference" / "cli" / "index.html").read_text()


def _load_rst() -> Any:
    spec = importlib.util.spec_from_file_location("docs_rst_docstrings", DOCS / "hooks" / "rst_docstrings.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rest_docstrings_become_markdown() -> None:
    rst = _load_rst().rst_to_markdown
    text = rst(
        "See :class:`~consumer_kit.app.App`, :mod:`consumer_kit.http` and ``ctx.publish(...,\n"
        "destination=...)``.\n\n"
        "=======  =====================\n"
        "module   job\n"
        "=======  =====================\n"
        "``a``    first line\n"
        "         continued\n"
        "``b``    other\n"
        "=======  =====================\n\n"
        "Example::\n\n"
        "    app = App(\"x\")\n"
    )
    assert "See `App`, `consumer_kit.http` and `ctx.publish(...,\ndestination=...)`." in text
    assert "| module | job |\n|---|---|\n| `a` | first line continued |\n| `b` | other |" in text
    assert "Example:\n\n```text\napp = App(\"x\")\n```" in text
