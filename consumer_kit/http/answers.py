"""The HTTP front door's answers: the one table from the operation state machine's verdicts on an
existing row to responses (draft-ietf-httpapi-idempotency-key-header-07 sections 2.6, 2.7), the HTTP
twin of :mod:`consumer_kit.pipeline.settlement`.

The rules that produce the verdicts live in :mod:`consumer_kit.pipeline.operation`, shared with
the message runtime; only the wording of each answer lives here. The projection-version policy is
the machine's: a row stored under a version of the route's intent that this request cannot be
compared under (not declared any more, or a body that cannot be projected under it) is never run
and never replayed: ``operation-needs-reconciliation`` (``409``).
"""

from __future__ import annotations

import hashlib
import logging

from starlette.responses import Response

from consumer_kit.errors import InvalidBody
from consumer_kit.http.intent import RequestIntent, RequestParts
from consumer_kit.http.policy import IdempotencyPolicy
from consumer_kit.http.problems import (
    KEY_REUSED,
    NEEDS_RECONCILIATION,
    REQUEST_OUTSTANDING,
    RESPONSE_EXPIRED,
    problem_response,
)
from consumer_kit.http.stored import REPLAYED_HEADER, StoredResponse
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.verdict import Verdict, VerdictKind
from consumer_kit.pipeline.operation import IntentUnder

__all__ = ["answer", "key_digest", "reconciling", "request_intent"]

logger = logging.getLogger("consumer_kit.http")

# The in-progress verdicts' details, by why ("" for any other).
_OUTSTANDING = {
    "claim_lock_timeout": "a request with this Idempotency-Key is being processed; retry after the time in Retry-After",
    "row_vanished": "the key's record changed; retry",
    "": "a request with this Idempotency-Key is being processed",
}


def key_digest(key: str) -> str:
    """The first 16 hex digits of SHA-256 of an idempotency key: what logs carry instead of it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def request_intent(intent: RequestIntent, parts: RequestParts) -> IntentUnder:
    """This request's fingerprint under an earlier version of the route's ``intent``; ``None`` when
    the route no longer declares it or the body cannot be projected under it (the intents cannot
    be compared: module docstring)."""

    def under(version: int) -> str | None:
        earlier = intent.under(version)
        if earlier is None:
            return None
        try:
            return earlier.fingerprint(parts)
        except InvalidBody:
            return None

    return under


def answer(verdict: Verdict, identity: OperationIdentity, policy: IdempotencyPolicy) -> Response:
    """The response for the state machine's ``verdict`` on an existing row."""
    digest, kind = key_digest(identity.key), verdict.kind
    if kind is VerdictKind.CONFLICT:
        logger.info("key reused scope=%s key_digest=%s: 422", identity.scope, digest)
        return problem_response(
            KEY_REUSED, policy.docs_url,
            "this Idempotency-Key was used with another request payload; a key must not be reused "
            "across different payloads of this operation",
        )
    if kind in (VerdictKind.DUPLICATE, VerdictKind.REPLAYED_FAILURE):
        row = verdict.deciding_row
        stored = StoredResponse.decoded(row.result_body)
        logger.debug("replay scope=%s key_digest=%s state=%s", identity.scope, digest, row.state)
        if stored is None:
            return problem_response(
                RESPONSE_EXPIRED, policy.docs_url,
                f"the operation finished ({row.state}, status {row.result_status}) and was not run again; "
                "its stored response is past its retention",
                headers={REPLAYED_HEADER: "true"},
            )
        return stored.replay()
    if kind is VerdictKind.NEEDS_RECONCILIATION:
        return reconciling(verdict, identity, policy)
    # in progress (or, defensively, anything the claim cannot yield): ask again later
    if verdict.why == "claim_lock_timeout":
        logger.info("request outstanding scope=%s key_digest=%s: 409", identity.scope, digest)
    detail = _OUTSTANDING.get(verdict.why, _OUTSTANDING[""])
    return problem_response(REQUEST_OUTSTANDING, policy.docs_url, detail, retry_after=policy.retry_after)


def reconciling(verdict: Verdict, identity: OperationIdentity, policy: IdempotencyPolicy) -> Response:
    """A parked operation, or one whose intent cannot be compared: never run, never replayed."""
    if verdict.why == "transaction_ended":  # this request's own endpoint ended the transaction
        return problem_response(
            NEEDS_RECONCILIATION, policy.docs_url,
            "the endpoint ended its own transaction; the operation awaits an operator and will not run again",
            status=500,
        )
    logger.warning(
        "operation needs reconciliation scope=%s key_digest=%s (%s)", identity.scope, key_digest(identity.key),
        verdict.why,
    )
    if verdict.why == "projection_unknown":
        detail = (
            "the first request with this key was stored under a version of this route's intent that it no "
            "longer declares, so the two cannot be compared; it will not run again until an operator decides"
        )
    else:
        detail = "the outcome of the first request with this key is being reconciled by an operator; it will not run again"
    return problem_response(NEEDS_RECONCILIATION, policy.docs_url, detail)
