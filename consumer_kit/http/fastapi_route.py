"""FastAPI: the route class that runs the idempotency protocol around marked endpoints.

    router = APIRouter(route_class=IdempotentRoute)

    @router.post("/invoices", status_code=201)
    @idempotency.endpoint(exclude={"requested_at"})
    async def create_invoice(command: InvoiceRequest, op: CurrentOperation) -> Invoice:
        ...

Routes whose endpoint has no ``@idempotency.endpoint()`` are served as usual. The protocol wraps
FastAPI's whole handler (body parsing, dependencies, validation, the endpoint, serialisation), so
what is stored is exactly the response FastAPI built, and a validation error (raised inside) is
rolled back and never stored. FastAPI's documented extension point for this is a custom
``APIRoute`` class overriding ``get_route_handler``.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from consumer_kit.http.integration import ENDPOINT_MARK, Idempotency
from consumer_kit.http.operation import Operation, current_operation
from consumer_kit.http.pipeline import EndpointSpec

CurrentOperation = Annotated[Operation, Depends(current_operation)]
"""An endpoint parameter ``op: CurrentOperation`` receives the request's :class:`Operation`."""


class IdempotentRoute(APIRoute):
    """An ``APIRoute`` that serves endpoints marked with ``@idempotency.endpoint()`` under
    ``Idempotency-Key``, and every other endpoint as ``APIRoute`` does."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        marked = getattr(self.endpoint, ENDPOINT_MARK, None)
        if marked is None:
            return handler
        idempotency: Idempotency = marked[0]
        spec: EndpointSpec = marked[1]

        async def idempotent_handler(request: Request) -> Response:
            return await idempotency.respond(request, spec, lambda: handler(request))

        return idempotent_handler
