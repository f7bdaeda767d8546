"""One-line and traceback descriptions of errors that name no business values.

An exception's own text may quote the payload (``invalid literal for int(): 'Jane Doe'``,
PostgreSQL's ``invalid input syntax for type integer: "..."``), so logs, spans, dead-letter
details and the attempts table get these descriptions instead of ``str(exc)``.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

# SQLSTATE class 22 (data exception) messages quote the offending value: "...: \"abc\"".
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def describe_error(exc: BaseException) -> str:
    """A one-line description of an error that names no business values.

    PostgreSQL errors give their SQLSTATE and primary message, which names objects (tables,
    constraints) but not row values (those are in the detail, left out); for data exceptions
    (SQLSTATE class 22), whose primary message quotes the rejected value, quoted text is replaced
    by ``"?"``. Other errors give their class and where they were raised (``file:line in
    function``), not their message. At most 300 characters.
    Shape: ``"UndefinedTable [42P01] relation \"invoices\" does not exist"`` or
    ``"KeyError at app.py:42 in handle"``.
    """
    diag = getattr(exc, "diag", None)
    sqlstate = getattr(exc, "sqlstate", None)
    if diag is not None and sqlstate:
        primary = (diag.message_primary or "").strip()
        if str(sqlstate).startswith("22"):
            primary = _QUOTED.sub('"?"', primary)
        return f"{type(exc).__name__} [{sqlstate}] {primary}"[:300]
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    return f"{type(exc).__name__} at {Path(last.filename).name}:{last.lineno} in {last.name}"


def describe_traceback(exc: BaseException, *, limit: int = 30) -> str:
    """The traceback of ``exc`` and its causes as ``file:line in function`` frames and exception
    class names only, most recent call last (the same shape as Python's, without any exception
    message or source line, which may quote business values)."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = traceback.extract_tb(current.__traceback__)[-limit:]
        lines = [f"  {Path(f.filename).name}:{f.lineno} in {f.name}" for f in frames]
        parts.append("\n".join([*lines, f"{type(current).__module__}.{type(current).__qualname__}"]))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return "\nwhich followed\n".join(reversed(parts)) if len(parts) > 1 else (parts[0] if parts else "")
