"""Producer text made safe to show on a terminal: keys, message ids, reasons and bodies come from
whoever could publish, and a terminal acts on some characters instead of showing them (ESC and CSI
start escape sequences that recolour, move the cursor or set the window title; bidi controls
reorder the text around them). Used by the operator commands (:mod:`consumer_kit.cli.console`)
and the log formatters (:mod:`consumer_kit.telemetry.logs`); imports nothing of consumer_kit."""

from __future__ import annotations

import re

BIDI_CONTROLS = frozenset(
    chr(code) for code in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
)
"""Unicode bidi embeddings, overrides, isolates and marks (U+202A-U+202E, U+2066-U+2069, LRM,
RLM, ALM): they reorder or hide the text around them."""

_SEPARATORS = "\u2028\u2029"
_SHOWN_ESCAPED = re.compile(
    "[\x00-\x1f\x7f-\x9f" + "".join(sorted(BIDI_CONTROLS)) + _SEPARATORS + "]"
)
_JSON_UNESCAPED = re.compile("[\x7f-\x9f" + "".join(sorted(BIDI_CONTROLS)) + _SEPARATORS + "]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str, *, double_backslash: bool = True) -> str:
    """``text`` with control characters (C0, DEL, C1) written ``\\x1b`` and bidi controls and line
    separators ``\\u202e``; with ``double_backslash`` a backslash is written ``\\\\`` first, so the
    result reads one way only (a literal ``\\x1b`` in the text is ``\\\\x1b``)."""
    if double_backslash and "\\" in text:
        text = text.replace("\\", "\\\\")
    return _SHOWN_ESCAPED.sub(_escape, text)


def escape_json_controls(json_text: str) -> str:
    """JSON written with ``ensure_ascii=False`` with the characters JSON leaves raw but a terminal
    acts on (DEL, C1, bidi controls, line separators) as ``\\u`` escapes: the same JSON value."""
    return _JSON_UNESCAPED.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)
