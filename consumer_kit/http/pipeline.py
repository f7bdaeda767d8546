"""One idempotent request, step by step: the HTTP twin of :mod:`consumer_kit.pipeline.runtime`.

``RequestPipeline.respond`` is the whole protocol of draft-ietf-httpapi-idempotency-key-header-07
("the draft") and reads as the numbered steps:

1. key: the ``Idempotency-Key`` field is parsed and checked against the published format before
   any lookup (section 2.1, section 5): missing or malformed, ``400``;
2. client: the API's ``client`` function authenticates the request and names its client (what it
   raises, e.g. a ``401``, passes through: nothing was looked up or stored);
3. the body, at most ``policy.max_body_bytes`` (by ``Content-Length``, then while it streams in),
   else ``413``; the fingerprint of the route's intent projection (section 2.4), in a worker
   thread for a large body (:mod:`consumer_kit.http.body`): a body without one meaning, ``400``;
   the scope is client + method + route template + API version (section 5);
4. BEGIN; claim (scope, key) with ``INSERT ... ON CONFLICT DO NOTHING``. A concurrent request of
   the same key waits on the unique index until the first one's transaction ends, at most
   ``lock_timeout``: then ``409`` with ``Retry-After`` (section 2.6 "Concurrent Request");
5. an existing row decides (section 2.6, 2.7), by the rules of the operation state machine
   (:mod:`consumer_kit.pipeline.operation`) that the message runtime uses too: another intent,
   ``422``; completed or failed, its stored response is replayed with ``Idempotent-Replayed: true``;
   in progress, ``409`` with ``Retry-After``; parked, or an intent that cannot be compared, ``409``
   ``operation-needs-reconciliation``;
6. SAVEPOINT, then the endpoint runs inside the transaction:

   - a response below 400: the ledger row is completed with the stored response and the
     endpoint's outbox events, in one statement;
   - a response of 400 or more: a rejection before the operation was accepted: ROLLBACK (the
     claim too), the response goes out as it is, nothing is stored (fix and retry, same key);
   - :class:`~consumer_kit.PermanentFailure` (or :class:`OperationFailed`): ROLLBACK TO SAVEPOINT
     (the endpoint's writes and events go, the claim stays) and the row becomes ``failed`` with
     its problem response, replayed to every retry;
   - any other exception: ROLLBACK, nothing stored, re-raised (the framework answers 500); a
     retry with the key runs the endpoint again;

7. COMMIT (with the session reset), then the response. A crash between the two leaves the
   completed row: the retry gets the replay (crash point ``after_commit_before_response``);
8. a fault of the database (unreachable, read-only, pool exhausted, a statement or the endpoint
   over its time, lock contention): ROLLBACK, ``503`` with ``Retry-After``, nothing stored. A COMMIT
   without a reply is ``503`` too: the retry reads the truth from the ledger (replay or run).

**Projection versions** (one policy with the message runtime): a row stored under another version
of the route's intent is compared under that version (``RequestIntent.earlier``). A version the
route no longer declares, or a body that cannot be projected under it, means the intents cannot be
compared: the request is never run and never answered with the stored response, but with the
``operation-needs-reconciliation`` problem (``409``), as the runtime dead-letters such a message as
``needs_reconciliation``. (Before the fix the front door answered ``422`` here.)
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool
from starlette.requests import Request
from starlette.responses import Response

from consumer_kit.errors import (
    BodyTooLarge,
    CommitUncertain,
    HandlerTimeout,
    InvalidBody,
    KeyRefused,
    MissingKey,
    PermanentFailure,
    ResponseNotStorable,
    StaleConnection,
    StatementTimeout,
    TransactionEnded,
)
from consumer_kit.http.answers import answer, key_digest, reconciling, request_intent
from consumer_kit.http.body import fingerprint as body_fingerprint
from consumer_kit.http.body import read_body
from consumer_kit.http.intent import RequestIntent, RequestParts
from consumer_kit.http.keys import IDEMPOTENCY_KEY_HEADER, idempotency_key
from consumer_kit.http.operation import Operation, serving, stop_serving
from consumer_kit.http.policy import IdempotencyPolicy
from consumer_kit.http.problems import (
    BODY_TOO_LARGE,
    INVALID_BODY,
    MALFORMED_KEY,
    MISSING_KEY,
    OPERATION_FAILED,
    RESPONSE_NOT_STORABLE,
    TRY_AGAIN,
    OperationFailed,
    ProblemType,
    problem_response,
)
from consumer_kit.http.scope import request_identity, route_template
from consumer_kit.http.stored import MAX_STORED_BODY_BYTES, StoredResponse
from consumer_kit.model.fence import Fence
from consumer_kit.model.identity import OperationIdentity
from consumer_kit.model.verdict import Verdict, VerdictKind
from consumer_kit.pipeline import crashpoints
from consumer_kit.pipeline.crashpoints import CrashPoint
from consumer_kit.pipeline.early_answers import EarlyAnswers
from consumer_kit.pipeline.faults import FaultKind, classify
from consumer_kit.pipeline.operation import Operations
from consumer_kit.pipeline.transaction import (
    begin,
    commit,
    commit_forbidden,
    ensure_transaction_open,
    ensure_transaction_usable,
    on_own_connection,
    rollback,
    within_handler_timeout,
)
from consumer_kit.settings import Settings
from consumer_kit.telemetry import describe_error

logger = logging.getLogger("consumer_kit.http")

ClientOf = Callable[[Request], "str | Awaitable[str]"]
"""The API's authentication: the request's client (or tenant) id, or an exception (e.g.
``HTTPException(401)``) that the framework answers."""

_SAVEPOINT = b"SAVEPOINT consumer_kit_endpoint"
_ROLLBACK_TO_SAVEPOINT = b"ROLLBACK TO SAVEPOINT consumer_kit_endpoint"
# A stored failure keeps its problem's link and no-store header besides the policy's own.
_FAILURE_HEADERS = frozenset({"link", "cache-control"})


@dataclass(frozen=True)
class EndpointSpec:
    """One idempotent endpoint's settings: its ``intent`` projection and, optionally, the
    ``operation_type`` of its scope instead of ``"<METHOD> <route template>"``."""

    intent: RequestIntent
    operation_type: str | None = None


@dataclass(frozen=True)
class _Answer:
    """What the transaction decided: the ``response``, whether to COMMIT, whether the endpoint
    ran to a stored outcome (``executed``), whether the transaction wrote anything (not when an
    existing row answered: its end then does not hold the response back)."""

    response: Response
    commit: bool
    executed: bool = False
    wrote: bool = True


class RequestPipeline:
    """Serves idempotent requests on the ledger of ``settings.db_schema``.

    Args:
        pool: an ``autocommit`` pool (:func:`consumer_kit.db.pool.open_pool`): its
            ``lock_timeout`` bounds the wait on a concurrent request of the same key.
        settings: ``statement_timeout`` (each statement of consumer-kit's own and the COMMIT),
            ``lock_timeout``, ``handler_timeout`` (the endpoint), ``lease_seconds``, ``db_schema``.
        policy: the API's published rules.
        client: the API's authentication (:data:`ClientOf`).
        worker_id: written as the claim's owner (``ledger show`` names it).
    """

    def __init__(
        self,
        pool: AsyncConnectionPool,
        settings: Settings,
        policy: IdempotencyPolicy,
        client: ClientOf,
        *,
        worker_id: str,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.policy = policy
        self.client = client
        self.worker_id = worker_id
        self.operations = Operations(settings, worker_id)
        self.early = EarlyAnswers(pool, settings.statement_timeout)

    async def close(self) -> None:
        """Wait until the transactions of replays answered before their end have ended (before
        the pool closes)."""
        await self.early.wait()

    async def respond(
        self, request: Request, endpoint: EndpointSpec, call: Callable[[], Awaitable[Response]]
    ) -> Response:
        """Answer ``request`` (steps in the module docstring); ``call`` runs the endpoint.

        Raises:
            Exception: what the client function or the endpoint raised, after the rollback.
        """
        try:  # step 1
            key = idempotency_key(request.headers.getlist(IDEMPOTENCY_KEY_HEADER), self.policy.key_format)
        except KeyRefused as refused:
            return self._problem(MISSING_KEY if isinstance(refused, MissingKey) else MALFORMED_KEY, refused.detail)
        client = await self._client_of(request)  # step 2
        try:  # step 3: within the limit, then parsed off the event loop when large
            body = await read_body(request, self.policy.max_body_bytes)
        except BodyTooLarge as exc:
            return self._problem(BODY_TOO_LARGE, exc.detail)
        parts = RequestParts(
            body, request.headers.get("content-type"), dict(request.path_params), request.query_params.multi_items(),
        )
        try:
            fingerprint = await body_fingerprint(endpoint.intent, parts)
        except InvalidBody as exc:
            return self._problem(INVALID_BODY, exc.detail)
        identity = request_identity(
            client=client, method=request.method, template=route_template(request),
            api_version=self.policy.api_version, key=key, fingerprint=fingerprint,
            projection_version=endpoint.intent.version, operation_type=endpoint.operation_type,
        )
        try:
            return await self._transaction(identity, client, endpoint, parts, call)
        except ResponseNotStorable as exc:
            logger.error(
                "response not storable scope=%s key_digest=%s: %s (rolled back)", identity.scope, key_digest(key), exc
            )
            return self._problem(RESPONSE_NOT_STORABLE, "the operation was rolled back: nothing happened")
        except TransactionEnded as exc:
            return await self._park(identity, exc)
        except CommitUncertain as exc:
            return self._try_again(identity, "the outcome is unknown (the COMMIT had no reply)", exc)
        except HandlerTimeout as exc:
            return self._try_again(identity, "the operation ran over its time and was rolled back", exc)
        except Exception as exc:
            if classify(exc) in (FaultKind.ENVIRONMENT, FaultKind.CONTENTION):
                return self._try_again(identity, "the database is unavailable or busy; nothing happened", exc)
            raise

    # -- steps 4 to 7 ----------------------------------------------------------------------------

    async def _transaction(
        self,
        identity: OperationIdentity,
        client: str,
        endpoint: EndpointSpec,
        parts: RequestParts,
        call: Callable[[], Awaitable[Response]],
    ) -> Response:
        """BEGIN, claim and run, COMMIT with the session reset (or ROLLBACK); the crash point
        between the COMMIT and the response."""
        for _ in range(self.pool.max_size + 1):
            try:
                answer = await self.early.on_connection(
                    lambda conn: self._ended(conn, identity, client, endpoint, parts, call)
                )
            except StaleConnection:
                continue  # a connection that died in the pool: not this request's fault
            break
        else:
            raise StatementTimeout("no live pooled connection")
        if answer.executed:
            crashpoints.reached(CrashPoint.AFTER_COMMIT_BEFORE_RESPONSE)
            logger.debug("committed scope=%s key_digest=%s", identity.scope, key_digest(identity.key))
        return answer.response

    async def _ended(
        self,
        conn: psycopg.AsyncConnection[Any],
        identity: OperationIdentity,
        client: str,
        endpoint: EndpointSpec,
        parts: RequestParts,
        call: Callable[[], Awaitable[Response]],
    ) -> tuple[_Answer, bool]:
        """BEGIN, claim and run, then COMMIT or ROLLBACK; the answer, and whether the transaction
        is still open (a replay wrote nothing: it ends later, the response goes at once)."""
        timeout = self.settings.statement_timeout
        await begin(conn, timeout)
        try:
            answer = await self._claim_and_run(conn, identity, client, endpoint, parts, call)
        except BaseException:
            await rollback(conn, timeout)
            raise
        if not answer.wrote:
            return answer, True
        if answer.commit:
            await commit(conn, timeout, reset=True)
        else:
            await rollback(conn, timeout)
        return answer, False

    async def _claim_and_run(
        self,
        conn: psycopg.AsyncConnection[Any],
        identity: OperationIdentity,
        client: str,
        endpoint: EndpointSpec,
        parts: RequestParts,
        call: Callable[[], Awaitable[Response]],
    ) -> _Answer:
        # step 4: may wait lock_timeout on a concurrent request of the key, then must answer
        claim = await self.operations.claim(
            conn, identity, request_intent(endpoint.intent, parts), message_id=None, retention=self.policy.retention
        )
        if isinstance(claim, Verdict):  # step 5
            if claim.kind is not VerdictKind.LEASE_RECOVERABLE:
                return _Answer(answer(claim, identity, self.policy), commit=False, wrote=False)
            # A claim the endpoint committed itself, whose process died before it could park it:
            # park it now, in this transaction, so that the gauges and `ledger list` (which read
            # watched rows only, ledger migration 5) see it.
            parked = await self.operations.park(
                conn, identity, message_id=None, error_class="LeaseExpired", why="lease_expired",
                detail="processing under an expired lease: the endpoint ended its own transaction "
                "and its process died before the key was parked",
            )
            return _Answer(answer(parked, identity, self.policy), commit=True)
        assert claim.xid is not None  # the claim inserted: the transaction has an id
        await conn.execute(_SAVEPOINT)
        operation = Operation(conn, identity, client)
        token = serving(operation)
        try:  # step 6
            try:
                with commit_forbidden(conn):
                    try:
                        response = await within_handler_timeout(call(), self.settings.handler_timeout)
                    finally:
                        operation.seal()
            finally:
                ensure_transaction_open(conn)
        except PermanentFailure as failure:
            return await self._record_failure(conn, identity, claim.xid, failure)
        finally:
            stop_serving(token)
        ensure_transaction_usable(conn)
        if response.status_code >= 400:
            logger.info(
                "rejected scope=%s key_digest=%s status=%s: rolled back, not stored",
                identity.scope, key_digest(identity.key), response.status_code,
            )
            return _Answer(response, commit=False)
        stored = StoredResponse.of(
            response, header_names=self.policy.header_names, max_body_bytes=self.policy.max_stored_body_bytes
        )
        await self.operations.complete(
            conn, identity, stored.result(), fence=Fence.of_transaction(claim.xid), events=operation.events,
            ran="the endpoint",
        )
        return _Answer(response, commit=True, executed=True)

    async def _record_failure(
        self, conn: psycopg.AsyncConnection[Any], identity: OperationIdentity, xid: str, failure: PermanentFailure
    ) -> _Answer:
        """Roll the endpoint's work back to the savepoint and record the failure with its problem
        response, in the claiming transaction."""
        await conn.execute(_ROLLBACK_TO_SAVEPOINT)
        status = failure.status if isinstance(failure, OperationFailed) else OPERATION_FAILED.status
        problem = self._problem(
            OPERATION_FAILED, failure.detail or failure.code, status=status, extensions={"code": failure.code}
        )
        stored = StoredResponse.of(
            problem, header_names=self.policy.header_names | _FAILURE_HEADERS, max_body_bytes=MAX_STORED_BODY_BYTES
        )
        await self.operations.fail_claimed(
            conn, identity, xid=xid, code=failure.code, error_class=type(failure).__name__,
            detail=failure.detail, body=stored.encoded(), ran="the endpoint",
        )
        logger.info("failed scope=%s key_digest=%s code=%s: recorded", identity.scope, key_digest(identity.key), failure.code)
        return _Answer(problem, commit=True, executed=True)

    # -- step 8 and helpers ----------------------------------------------------------------------

    async def _client_of(self, request: Request) -> str:
        client = self.client(request)
        if inspect.isawaitable(client):
            client = await client
        return client

    async def _park(self, identity: OperationIdentity, exc: TransactionEnded) -> Response:
        """The endpoint committed or rolled back the request's transaction itself: part of its
        effect may be durable without the ledger's completion. Park the key; never re-run it."""
        logger.error(
            "scope=%s key_digest=%s: %s; parked as needs_reconciliation", identity.scope, key_digest(identity.key), exc
        )
        parked = await on_own_connection(
            self.pool, self.settings.statement_timeout,
            lambda conn: self.operations.park(
                conn, identity, message_id=None, error_class=TransactionEnded.__name__, why="transaction_ended",
                detail=str(exc),
            ),
            "parking",
        )
        return reconciling(parked, identity, self.policy)

    def _try_again(self, identity: OperationIdentity, detail: str, exc: BaseException) -> Response:
        logger.warning(
            "try again scope=%s key_digest=%s: %s (%s)", identity.scope, key_digest(identity.key), detail,
            describe_error(exc),
        )
        return self._problem(
            TRY_AGAIN, f"{detail}; retry with the same Idempotency-Key", retry_after=self.policy.retry_after
        )

    def _problem(self, kind: ProblemType, detail: str, **options: Any) -> Response:
        return problem_response(kind, self.policy.docs_url, detail, **options)
