"""The operation ledger: ``operations`` (one row per operation: claim, state, result, lease),
``attempts`` (consumer-kit's own count of faults, contentions and crashes per operation) and
``evidence`` (what handlers with external effects recorded about their remote calls).

All ledger SQL lives in this package, built with ``psycopg.sql`` (the schema name is an
identifier, never formatted by hand).
"""

from consumer_kit.ledger.attempts import AttemptBook, AttemptCounts, AttemptRecord
from consumer_kit.ledger.evidence import EvidenceBook
from consumer_kit.ledger.migrations import LEDGER_MIGRATIONS, migrate, missing_migrations, schema_ready
from consumer_kit.ledger.operations import BatchClaim, Claim, Ledger

__all__ = [
    "LEDGER_MIGRATIONS",
    "AttemptBook",
    "AttemptCounts",
    "AttemptRecord",
    "BatchClaim",
    "Claim",
    "EvidenceBook",
    "Ledger",
    "migrate",
    "missing_migrations",
    "schema_ready",
]
