"""MkDocs hook: the reference pages that are generated from the code, so that none can drift.

A page asks for a generated part with a marker line of its own:

* ``<!-- generated: settings -->``: every ``CONSUMER_KIT_*`` setting, from the pydantic settings
  models (:func:`settings_markdown`);
* ``<!-- generated: cli -->``: every command and option of ``consumer-kit`` and ``outbox-relay``,
  from their typer apps (:func:`cli_markdown`);
* ``<!-- generated: metrics -->``: every metric, from
  :data:`consumer_kit.telemetry.metrics.CATALOGUE` (:func:`metrics_markdown`).

A marker nobody knows stops the build (a typo must not publish an empty page).

It also lays out the installed package tree for mkdocstrings (:func:`build_source_mirror`): griffe's
static loader reads files by their import names, and pyproject.toml maps some folders under other
names (``adapters/`` installs as ``consumer_kit.adapters``), so ``build/docs-src`` holds links to the
real files in the installed layout (:func:`consumer_kit._checkout.lay_out`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable
from html import escape
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MIRROR = ROOT / "build" / "docs-src"
"""Where mkdocstrings reads the sources (``paths`` in mkdocs.yml)."""
MARKER = re.compile(r"^<!-- generated: ([a-z_-]+) -->$", re.M)


# -- the source mirror for mkdocstrings --------------------------------------------------------------


def build_source_mirror(root: Path = ROOT, mirror: Path = MIRROR) -> Path:
    """Lay out ``mirror/consumer_kit`` as the wheel installs it (links to the repository's files,
    never copies: a page always documents the code as it is). Returns ``mirror``."""
    from consumer_kit._checkout import lay_out

    return lay_out(mirror, root)


# -- settings ------------------------------------------------------------------------------------------


def settings_markdown() -> str:
    """The settings reference, rendered by the settings tree itself
    (:func:`consumer_kit.settings.reference.render_markdown`)."""
    from consumer_kit.settings.reference import render_markdown

    return str(render_markdown())


def _cell(text: str) -> str:
    """Table-safe: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


# -- CLI -------------------------------------------------------------------------------------------------


def cli_markdown() -> str:
    """Every command of ``consumer-kit`` and ``outbox-relay`` with its usage, help and options,
    read from the typer apps (what ``--help`` prints, as one page)."""
    import typer.main

    from consumer_kit.cli.main import cli
    from consumer_kit.outbox_relay.cli import app as relay_app

    parts: list[str] = []
    for name, typer_app in (("consumer-kit", cli), ("outbox-relay", relay_app)):
        parts.extend(_command_sections(typer.main.get_command(typer_app), [name], level=2))
    return "\n\n".join(parts) + "\n"


def _command_sections(command: Any, path: list[str], level: int, parent: Any = None) -> Iterable[str]:
    # Duck-typed on click's Command/Group/Context API: typer vendors its own click.
    ctx = command.context_class(command, info_name=path[-1], parent=parent)
    usage = re.sub(r"\{(\w+)\}", lambda m: m.group(1).upper(), " ".join(command.collect_usage_pieces(ctx)))
    lines = [f"{'#' * level} `{' '.join(path)}`", ""]
    help_text = _clean_help(command.help or command.short_help or "")
    if help_text:
        lines += [help_text, ""]
    lines += ["```text", f"{' '.join(path)} {usage}".rstrip(), "```"]
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
    if arguments or options:
        lines += ["", "| argument or option | meaning | default |", "|---|---|---|"]
        for argument in arguments:
            lines.append(f"| `{(argument.metavar or argument.name.upper())}` | {_cell(_clean_help(getattr(argument, 'help', '') or ''))} | |")
        for option in options:
            names = ", ".join(f"`{o}`" for o in option.opts)
            if option.secondary_opts:
                names += " / " + ", ".join(f"`{o}`" for o in option.secondary_opts)
            lines.append(f"| {names} | {_cell(_clean_help(option.help or ''))} | {_cell(_option_default(option))} |")
    yield "\n".join(lines)
    if hasattr(command, "list_commands"):
        for sub_name in command.list_commands(ctx):
            sub = command.get_command(ctx, sub_name)
            if sub is not None and not sub.hidden:
                yield from _command_sections(sub, [*path, sub_name], min(level + 1, 4), ctx)


def _clean_help(text: str) -> str:
    """Typer/rich markup out, the first paragraph's line breaks joined."""
    text = text.split("\f")[0]
    text = re.sub(r"\[/?(?:bold|dim|italic|cyan|green|red|yellow|b|i)\]", "", text)
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip())]
    return "\n\n".join(p for p in paragraphs if p)


def _option_default(option: Any) -> str:
    if option.is_flag and not option.secondary_opts and option.default in (False, None):
        return ""
    default = option.default
    if default is None or callable(default):
        return ""
    if isinstance(default, bool) and option.secondary_opts:
        return f"`{option.opts[0] if default else option.secondary_opts[0]}`"
    if isinstance(default, enum.Enum):
        default = default.value
    return f"`{default}`"


# -- metrics --------------------------------------------------------------------------------------------


def metrics_markdown() -> str:
    """The metrics catalogue: one row per :class:`~consumer_kit.telemetry.metrics.MetricSpec`, in
    three columns that wrap on a narrow page (the names, what kind, what it means)."""
    from consumer_kit.telemetry.metrics import CATALOGUE

    rows = [
        f"| `{spec.name}`<br>Prometheus: {', '.join(f'`{n}`' for n in spec.prometheus_names)}"
        f" | {spec.kind}, unit `{spec.unit}`, from the {spec.emitted_by}"
        f" | {_cell(spec.description).rstrip('.')}. Attributes: {', '.join(f'`{a}`' for a in spec.attributes) or 'none'}. |"
        for spec in CATALOGUE
    ]
    return "| metric | kind | meaning |\n|---|---|---|\n" + "\n".join(rows) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings_markdown, "cli": cli_markdown, "metrics": metrics_markdown,
}


def render_markers(markdown: str, page_name: str = "page") -> str:
    """``markdown`` with every marker line replaced by its generated part.

    Raises:
        ValueError: a marker that names no generator (``page_name`` says where).
    """
    def replace(match: re.Match[str]) -> str:
        generator = GENERATORS.get(match.group(1))
        if generator is None:
            raise ValueError(f"{page_name}: unknown generated part {match.group(1)!r}; known: {sorted(GENERATORS)}")
        return generator().rstrip("\n")

    return MARKER.sub(replace, markdown)


# -- MkDocs events ----------------------------------------------------------------------------------------


# At import, which MkDocs does while it reads mkdocs.yml: mkdocstrings resolves its paths in its
# own on_config, which runs before a hook's.
build_source_mirror()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return render_markers(markdown, page.file.src_uri)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return label_table_cells(html)


# -- tables on a phone ----------------------------------------------------------------------------------

_TABLE = re.compile(r"<table>(.*?)</table>", re.S)
_HEADER_CELL = re.compile(r"<th[^>]*>(.*?)</th>", re.S)
_ROW = re.compile(r"<tr>(.*?)</tr>", re.S)
_DATA_CELL = re.compile(r"<td(?=[ >])")
_TAG = re.compile(r"<[^>]+>")


def label_table_cells(html: str) -> str:
    """Every ``<td>`` of the page's Markdown tables with ``data-label`` = its column's header, so
    that on a narrow screen docs/stylesheets/extra.css can show each row as a block of labelled
    lines instead of a table wider than the phone."""
    def label(table: re.Match[str]) -> str:
        body = table.group(1)
        head, _, rest = body.partition("</thead>")
        names = [escape(_TAG.sub("", cell).strip(), quote=True) for cell in _HEADER_CELL.findall(head)]
        if not names or not rest:
            return table.group(0)

        def row(match: re.Match[str]) -> str:
            cells = iter(names)
            return "<tr>" + _DATA_CELL.sub(lambda m: f'<td data-label="{next(cells, "")}"', match.group(1)) + "</tr>"

        return "<table>" + head + "</thead>" + _ROW.sub(row, rest) + "</table>"

    return _TABLE.sub(label, html)
