"""Griffe extension: the project's docstrings are written in reStructuredText (Sphinx roles,
``double backticks``, simple tables, ``::`` literal blocks); mkdocstrings renders Markdown. This
turns the constructs the code uses into their Markdown equivalents before rendering, so the API
pages read as the source does. The docstrings themselves stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|mod|func|meth|data|attr|exc|obj|const):`(~?)([^`]+)`")
LITERAL = re.compile(r"``((?:(?!``|\n\s*\n).)+?)``", re.S)
BORDER = re.compile(r"^(\s*)(=+)((?: +=+)+)\s*$")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2).strip()
    if "<" in target and target.endswith(">"):  # :class:`text <target>`
        target = target.split("<", 1)[0].strip()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _columns(border: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", border)]


def _cell(line: str, start: int, end: int | None) -> str:
    return line[start:end].strip() if end is not None else line[start:].strip()


def _table(lines: list[str], indent: str) -> list[str]:
    """A reST simple table (border, header, border, rows, border) as a Markdown table. A row whose
    first cell is empty continues the row above."""
    columns = _columns(lines[0])
    starts = [start for start, _ in columns]
    bounds = [(start, starts[i + 1] if i + 1 < len(starts) else None) for i, start in enumerate(starts)]
    rows: list[list[str]] = []
    borders = 0
    header: list[str] | None = None
    for line in lines[1:]:
        if BORDER.match(line):
            borders += 1
            if borders == 1:
                header = rows.pop() if rows else None
            continue
        if not line.strip():
            continue
        cells = [_cell(line, start, end) for start, end in bounds]
        if rows and not cells[0]:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells, strict=True)]
        else:
            rows.append(cells)
    if header is None:
        header, rows = rows[0], rows[1:]
    out = [indent + "| " + " | ".join(header) + " |", indent + "|" + "---|" * len(header)]
    out += [indent + "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return ["", *out, ""]


def rst_to_markdown(text: str) -> str:
    """``text`` (a docstring in reST) with roles, literals, simple tables and ``::`` blocks in
    Markdown."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = BORDER.match(lines[i])
        if match:
            # A simple table runs to its third border line (or the second, without a header).
            j, borders = i + 1, 1
            while j < len(lines) and borders < 3:
                if BORDER.match(lines[j]):
                    borders += 1
                elif not lines[j].strip() and borders == 2 and j + 1 < len(lines) and not lines[j + 1].strip():
                    break
                j += 1
            out += _table(lines[i:j], match.group(1))
            i = j
            continue
        out.append(lines[i])
        i += 1
    text = LITERAL.sub(lambda m: f"`{m.group(1)}`", ROLE.sub(_role, "\n".join(out)))
    return "\n".join(_fence_literal_blocks(text.split("\n")))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _fence_literal_blocks(lines: list[str]) -> list[str]:
    """``text::`` + an indented block: "text:" and the block fenced as code (a lone ``::`` line
    only introduces it), so neither Markdown nor the Google-style parser reads it as prose."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        k = j
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > base):
            k += 1
        while k > j and not lines[k - 1].strip():
            k -= 1
        if k == j:  # no block follows: plain text
            out.append(line)
            i += 1
            continue
        head = line.rstrip()[:-2].rstrip()
        if head.strip():
            out.append(head + ":")
        block = lines[j:k]
        inner = min(_indent(b) for b in block if b.strip())
        pad = " " * base  # at the text's own level: the block is prose's example, never a section
        out += ["", pad + "```text", *(pad + b[inner:] if b.strip() else "" for b in block), pad + "```", ""]
        i = k
    return out


class RstToMarkdown(griffe.Extension):
    """Rewrites every object's docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
