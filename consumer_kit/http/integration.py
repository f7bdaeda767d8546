"""Wiring the HTTP front door into an app: :class:`Idempotency` and its endpoint decorator.

Starlette: decorate an ``async def endpoint(request) -> Response``; the decorator runs the whole
protocol (:mod:`consumer_kit.http.pipeline`) around it::

    @idempotency.endpoint(exclude={"requested_at"})
    async def create_invoice(request: Request) -> Response:
        op = current_operation()
        ...
    app = Starlette(routes=[Route("/invoices", create_invoice, methods=["POST"])],
                    lifespan=idempotency.lifespan)

FastAPI: the same decorator marks the endpoint; the router's ``route_class=IdempotentRoute``
(:mod:`consumer_kit.http.fastapi_route`) runs the protocol around FastAPI's own handler, so the
stored response is the one FastAPI serialised, and request validation, which runs inside, is never
stored. The endpoint gets its :class:`~consumer_kit.http.Operation` as a parameter
``op: CurrentOperation`` (``Annotated[Operation, Depends(current_operation)]``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

from psycopg_pool import AsyncConnectionPool
from starlette.requests import Request
from starlette.responses import Response

from consumer_kit.db.pool import open_pool
from consumer_kit.errors import ConfigurationError
from consumer_kit.http.intent import RequestIntent
from consumer_kit.http.operation import is_serving
from consumer_kit.http.pipeline import ClientOf, EndpointSpec, RequestPipeline
from consumer_kit.http.policy import IdempotencyPolicy
from consumer_kit.identity import check_scope_parts
from consumer_kit.ledger.mark_keys import install_mark_keys
from consumer_kit.pipeline.runtime import default_worker_id
from consumer_kit.settings import Settings

Endpoint = TypeVar("Endpoint", bound=Callable[..., Awaitable[Any]])

ENDPOINT_MARK = "__consumer_kit_idempotent__"
"""Attribute of a decorated endpoint: ``(Idempotency, EndpointSpec)``, read by ``IdempotentRoute``."""


class Idempotency:
    """The HTTP front door of one API on consumer-kit's ledger.

    Args:
        settings: database and timeouts (``database_url``, ``db_schema``, ``search_path``,
            ``lock_timeout``, ``statement_timeout``, ``handler_timeout``, ``pool_size``).
        client: the API's authentication: ``client(request)`` returns (or awaits) the
            authenticated client or tenant id, or raises (e.g. ``HTTPException(401)``). It runs
            before the endpoint's own dependencies: read what an authentication middleware left
            (``request.user``, ``request.state``) or verify a credential header here.
        policy: the published rules (key format, API version, stored-response limit, retention).
        pool: an open ``autocommit`` pool to use (else :meth:`open` opens one from ``settings``).
        worker_id: the claims' owner name; default ``host:pid:random``.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        client: ClientOf,
        policy: IdempotencyPolicy,
        pool: AsyncConnectionPool | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        self.policy = policy
        self.worker_id = worker_id or default_worker_id()
        self._pool = pool
        self._owns_pool = pool is None
        self._keys_installed = False
        self._pipeline: RequestPipeline | None = None if pool is None else self._pipeline_on(pool)

    @property
    def pool(self) -> AsyncConnectionPool:
        """The connection pool (the endpoints' transactions come from it).

        Raises:
            ConfigurationError: not open yet.
        """
        if self._pool is None:
            raise ConfigurationError("Idempotency is not open: run the app with lifespan=idempotency.lifespan")
        return self._pool

    async def open(self) -> None:
        """Open the pool from ``settings`` (unless one was given).

        Raises:
            ConfigurationError: no ``database_url``, or PostgreSQL unreachable.
        """
        if self._pool is None:
            if not self.settings.database_url:
                raise ConfigurationError("CONSUMER_KIT_DATABASE_URL is not set: the API needs the ledger's database")
            self._pool = await open_pool(self.settings, self.settings.database_url, search_path=self.settings.search_path)
        if not self._keys_installed:  # event ids are keyed by it (consumer_kit.outbox.event_id_for)
            async with self._pool.connection() as conn:
                await install_mark_keys(conn, self.settings)
            self._keys_installed = True
        if self._pipeline is None:
            self._pipeline = self._pipeline_on(self._pool)

    async def close(self) -> None:
        """Close the pool this object opened (a pool given to it stays open), once the requests
        answered before their transaction's end have ended it."""
        if self._pipeline is not None:
            await self._pipeline.close()
        if self._owns_pool and self._pool is not None:
            await self._pool.close()
            self._pool = None
            self._pipeline = None

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """Open at start-up, close at shutdown: ``FastAPI(lifespan=idempotency.lifespan)``."""
        await self.open()
        try:
            yield
        finally:
            await self.close()

    def endpoint(
        self,
        *,
        exclude: Iterable[str] = (),
        query: bool | Iterable[str] = True,
        projection_version: int = 1,
        earlier: Mapping[int, RequestIntent] | None = None,
        operation_type: str | None = None,
    ) -> Callable[[Endpoint], Endpoint]:
        """Make an ``async`` endpoint idempotent under ``Idempotency-Key``.

        Args:
            exclude: volatile JSON body fields left out of the fingerprint (dotted for nested).
            query: query parameters in the fingerprint: all, none (``False``) or these names.
            projection_version: version of this intent projection; ``earlier`` maps earlier
                versions still in retention to their :class:`RequestIntent`.
            operation_type: the scope's operation name instead of ``"<METHOD> <route template>"``.

        Raises:
            ConfigurationError: the endpoint is not ``async def``, or ``operation_type`` is longer
                than the ledger's index holds (512 bytes of UTF-8).
        """
        if operation_type is not None:
            check_scope_parts(operation_type, self.policy.api_version, owner="an idempotent endpoint")
        spec = EndpointSpec(
            RequestIntent(
                exclude=frozenset(exclude), query=query if isinstance(query, bool) else frozenset(query),
                version=projection_version, earlier=earlier,
            ),
            operation_type,
        )

        def decorate(function: Endpoint) -> Endpoint:
            if not inspect.iscoroutinefunction(function):
                raise ConfigurationError(f"idempotent endpoint {function.__name__} must be `async def`")

            @functools.wraps(function)
            async def idempotent(*args: Any, **kwargs: Any) -> Any:
                if is_serving():  # FastAPI: IdempotentRoute runs the protocol around this call
                    return await function(*args, **kwargs)
                if len(args) == 1 and not kwargs and isinstance(args[0], Request):  # Starlette
                    request = args[0]
                    return await self.respond(request, spec, lambda: function(request))
                raise ConfigurationError(
                    f"{function.__name__} is idempotent but was called outside the protocol: on FastAPI, "
                    "create its router with route_class=consumer_kit.http.IdempotentRoute"
                )

            setattr(idempotent, ENDPOINT_MARK, (self, spec))
            return cast(Endpoint, idempotent)

        return decorate

    async def respond(
        self, request: Request, spec: EndpointSpec, call: Callable[[], Awaitable[Response]]
    ) -> Response:
        """Serve ``request`` under the protocol (:class:`RequestPipeline`); ``call`` runs the
        endpoint and returns its response.

        Raises:
            ConfigurationError: not open (no lifespan).
        """
        if self._pipeline is None:
            raise ConfigurationError("Idempotency is not open: run the app with lifespan=idempotency.lifespan")
        return await self._pipeline.respond(request, spec, call)

    def _pipeline_on(self, pool: AsyncConnectionPool) -> RequestPipeline:
        return RequestPipeline(pool, self.settings, self.policy, self.client, worker_id=self.worker_id)
