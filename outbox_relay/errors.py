"""The relay's own errors (docs/explanation/architecture.md, "Errors")."""

from __future__ import annotations


class UnknownDestination(Exception):
    """A row's destination is not in the destination map."""
