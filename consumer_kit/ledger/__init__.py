"""The operation ledger: ``operations`` (one row per operation: claim, state, result) and
``attempts`` (consumer-kit's own count of faults, contentions and crashes per operation).

All ledger SQL lives in this package, built with ``psycopg.sql`` (the schema name is an
identifier, never formatted by hand).
"""

from consumer_kit.ledger.attempts import AttemptBook, AttemptCounts, AttemptRecord
from consumer_kit.ledger.migrations import LEDGER_MIGRATIONS, migrate, missing_migrations, schema_ready
from consumer_kit.ledger.operations import (
    COMPLETED,
    FAILED,
    NEEDS_RECONCILIATION,
    PROCESSING,
    Ledger,
    OperationRow,
)

__all__ = [
    "COMPLETED",
    "FAILED",
    "LEDGER_MIGRATIONS",
    "NEEDS_RECONCILIATION",
    "PROCESSING",
    "AttemptBook",
    "AttemptCounts",
    "AttemptRecord",
    "Ledger",
    "OperationRow",
    "migrate",
    "missing_migrations",
    "schema_ready",
]
