"""The settings reference page, generated from the settings tree (:data:`consumer_kit.settings.SETTINGS_GROUPS`)
so it cannot drift from the code: one table per group with each setting's environment variable (or
URL option), type, unit, range, default and description.

``python -m consumer_kit.settings.reference`` prints it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from consumer_kit.settings import GROUP_READERS, SETTINGS_GROUPS, GroupSettings, number, own_fields
from consumer_kit.settings.sqs import URL_OPTION


@dataclass(frozen=True)
class SettingRow:
    """One setting as the reference page shows it.

    Attributes:
        group: the group's name (``worker``).
        name: the variable (``CONSUMER_KIT_LOCK_TIMEOUT``) or URL option (``sqs://...?wait=``).
        type: the Python type as written in the model (``float``, ``int | None``).
        unit: ``seconds``, ``deliveries``, ...; empty for a setting without a numeric range.
        range: ``0.001 to 3600``; empty for a setting without a numeric range.
        default: the default as a user would type it; ``(unset)`` for ``None``; ``(computed)`` for
            a default computed at start-up.
        description: the field's description.
    """

    group: str
    name: str
    type: str
    unit: str
    range: str
    default: str
    description: str


def rows(group: str) -> list[SettingRow]:
    """The own settings of ``group`` (not those of the groups it builds on), in declaration order.

    Raises:
        KeyError: no such group.
    """
    model = SETTINGS_GROUPS[group]
    return [_row(group, model, name, model.model_fields[name]) for name in own_fields(group)]


def _row(group: str, model: type[BaseModel], name: str, field: FieldInfo) -> SettingRow:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    unit, bounds = "", ""
    if "minimum" in extra:
        unit = str(extra["unit"])
        bounds = f"{number(float(str(extra['minimum'])))} to {number(float(str(extra['maximum'])))}"
    elif "range" in extra:  # a list of numbers states its range in words
        unit, bounds = str(extra.get("unit", "")), str(extra["range"])
    variable = (
        model.env_name_of(name) if issubclass(model, GroupSettings) else URL_OPTION.format(name=name)
    )
    return SettingRow(
        group=group, name=variable, type=_type_name(field.annotation), unit=unit, range=bounds,
        default=_default(field), description=field.description or "",
    )


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return text or str(annotation).replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return "(computed)"
    value = field.default
    if value is None or value is PydanticUndefined:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return number(value)
    if isinstance(value, list):
        return ",".join(number(v) if isinstance(v, float) else str(v) for v in value) or "(empty)"
    return str(value)


def _cell(text: str) -> str:
    """A Markdown table cell: pipes escaped, no line breaks."""
    return text.replace("|", "\\|").replace("\n", " ") or "-"


def render_markdown() -> str:
    """The settings reference as Markdown, for a page that has its own title and introduction
    (the docs' ``<!-- generated: settings -->`` marker): per group a ``##`` heading, who reads it,
    and a table of its settings in three columns that wrap on a narrow page (docs/development.md):
    the variable or URL option with its type, unit and range; the default; the description."""
    lines: list[str] = []
    for group in SETTINGS_GROUPS:
        lines += [f"## {group}", "", GROUP_READERS.get(group, ""), ""]
        lines += ["| setting | default | description |", "|---|---|---|"]
        for row in rows(group):
            # "int or None", not "int | None": a pipe in a table's code span shows its escape.
            kind = ", ".join(part for part in (f"`{row.type.replace(' | ', ' or ')}`", row.unit, row.range) if part)
            cells = (f"`{row.name}`<br>{kind}", f"`{row.default}`", row.description)
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a tool
    sys.stdout.write(render_markdown())
