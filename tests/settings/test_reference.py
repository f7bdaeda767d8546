"""The generated settings reference covers the whole tree: every setting has a description, every
numeric one a unit and a range, and no CONSUMER_KIT_* variable is read outside the tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from consumer_kit.settings import SETTINGS_GROUPS, all_env_names, own_fields
from consumer_kit.settings.reference import render_markdown, rows

ROOT = Path(__file__).resolve().parents[2]
NUMERIC = re.compile(r"\b(int|float)\b")


@pytest.mark.parametrize("group", list(SETTINGS_GROUPS))
def test_every_setting_of_every_group_has_a_description_and_numbers_have_a_unit_and_a_range(group: str) -> None:
    found = rows(group)
    assert [row.name.removeprefix("sqs://...?").removesuffix("=").lower() for row in found] == [
        (SETTINGS_GROUPS[group].env_name_of(name) if hasattr(SETTINGS_GROUPS[group], "env_name_of") else name).lower()
        for name in own_fields(group)
    ]
    for row in found:
        assert row.description.strip(), f"{row.name} has no description"
        if NUMERIC.search(row.type):
            assert row.unit and row.range, f"{row.name} ({row.type}) has no unit or range"


def test_the_page_lists_every_variable_of_the_tree_once_with_its_group_heading() -> None:
    page = render_markdown()
    for variable in all_env_names():
        assert page.count(f"`{variable}`") == 1, variable
    for group in SETTINGS_GROUPS:
        assert re.search(rf"^## {group}$", page, re.MULTILINE), group
    assert "| `CONSUMER_KIT_LOCK_TIMEOUT`<br>`float`, seconds, 0.001 to 3600 | `5` |" in page
    assert "| `sqs://...?wait=`<br>`int`, seconds, 0 to 20 | `10` |" in page
    assert "`str or None`" in page and "\\|" not in page  # no escaped pipe: it would show


def test_each_setting_belongs_to_exactly_one_group() -> None:
    seen: dict[str, str] = {}
    for group in SETTINGS_GROUPS:
        for name in own_fields(group):
            assert name not in seen, f"{name} is in {seen[name]} and {group}"
            seen[name] = group


def test_no_consumer_kit_variable_is_read_outside_the_settings_tree() -> None:
    """os.environ/getenv and typer's envvar= outside consumer_kit/settings/ may read only the
    test-only variables (crash points, the testing kit's database)."""
    allowed = {"CONSUMER_KIT_CRASH_AT", "CONSUMER_KIT_TEST_DATABASE_URL", "CONSUMER_KIT_DATABASE_URL"}
    reads = re.compile(
        r"""(?:environ\.get\(|getenv\(|environ\[|envvar=)\s*["'](CONSUMER_KIT_[A-Z_]+)"""
        r"""|["'](CONSUMER_KIT_[A-Z_]+)["']\s+(?:not\s+)?in\s+os\.environ"""
    )
    offenders = []
    for folder in ("consumer_kit", "adapters", "outbox_relay"):
        for path in (ROOT / folder).rglob("*.py"):
            if "settings" in path.relative_to(ROOT).parts[1:2]:
                continue
            for match in reads.findall(path.read_text()):
                variable = match[0] or match[1]
                if variable not in allowed:
                    offenders.append(f"{path.relative_to(ROOT)}: {variable}")
    assert offenders == []
