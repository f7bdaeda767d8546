"""what an existing ledger row means, decided in one place for the runtime, the leased
path and the HTTP front door (consumer_kit.pipeline.operation): no database needed."""

from __future__ import annotations

import dataclasses

import pytest

from consumer_kit import Settings
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.operation_row import COMPLETED, FAILED, NEEDS_RECONCILIATION, PROCESSING, OperationRow
from consumer_kit.model.verdict import VerdictKind
from consumer_kit.pipeline.operation import Operations

IDENTITY = OperationIdentity("acme", "invoice.create", 1, "k-1", "fp-v2", 2)
ROW = OperationRow(
    scope=IDENTITY.scope, key="k-1", fingerprint="fp-v2", projection_version=2, state=COMPLETED, attempts=1,
    lease_owner=None, lease_live=False, result_status="created", result_reference="inv-1", result_body=None,
    error_class=None, error_detail=None, completed_at=None,
)


def never(version: int) -> str | None:
    raise AssertionError("the earlier projection is asked for only when the versions differ")


@pytest.fixture
def machine() -> Operations:
    return Operations(Settings(database_url="postgresql://nobody@127.0.0.1:1/none"), "w-1")


@pytest.mark.parametrize(
    ("state", "lease_live", "kind", "why"),
    [
        (COMPLETED, False, VerdictKind.DUPLICATE, ""),
        (FAILED, False, VerdictKind.REPLAYED_FAILURE, "created"),
        (NEEDS_RECONCILIATION, False, VerdictKind.NEEDS_RECONCILIATION, "parked"),
        (PROCESSING, True, VerdictKind.IN_PROGRESS, "lease_held"),
        (PROCESSING, False, VerdictKind.LEASE_RECOVERABLE, ""),
    ],
)
def test_a_row_of_the_same_intent_decides_by_its_state(
    machine: Operations, state: str, lease_live: bool, kind: VerdictKind, why: str
) -> None:
    row = dataclasses.replace(ROW, state=state, lease_live=lease_live)
    verdict = machine.decide(row, IDENTITY, never)
    assert (verdict.kind, verdict.why, verdict.row) == (kind, why, row)


def test_another_fingerprint_under_the_same_version_is_a_conflict_whatever_the_state(machine: Operations) -> None:
    for state in (COMPLETED, FAILED, NEEDS_RECONCILIATION, PROCESSING):
        row = dataclasses.replace(ROW, fingerprint="fp-other", state=state)
        assert machine.decide(row, IDENTITY, never).kind is VerdictKind.CONFLICT


def test_a_row_of_an_earlier_version_is_compared_under_that_version(machine: Operations) -> None:
    row = dataclasses.replace(ROW, fingerprint="fp-v1", projection_version=1)
    asked: list[int] = []

    def under(version: int) -> str | None:
        asked.append(version)
        return "fp-v1"

    assert machine.decide(row, IDENTITY, under).kind is VerdictKind.DUPLICATE
    assert asked == [1]
    assert machine.decide(row, IDENTITY, lambda version: "fp-v1-other").kind is VerdictKind.CONFLICT


def test_a_row_of_a_version_that_cannot_be_computed_any_more_is_never_a_duplicate(machine: Operations) -> None:
    for state in (COMPLETED, FAILED, PROCESSING):
        row = dataclasses.replace(ROW, fingerprint="fp-v1", projection_version=1, state=state)
        verdict = machine.decide(row, IDENTITY, lambda version: None)
        assert (verdict.kind, verdict.why) == (VerdictKind.NEEDS_RECONCILIATION, "projection_unknown")
        assert "intents cannot be compared" in verdict.detail
