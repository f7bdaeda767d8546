"""The scope of an idempotency key: authenticated client + method + route template + API version.

draft-ietf-httpapi-idempotency-key-header-07, section 5 "Security Considerations": implement the
lookup key as a composite of the client's key and client-specific attributes known only to the
server, so that one client can never find (or replay) another client's stored response. The
ledger's scope is ``<tenant>/<operation type>/v<version>`` (:func:`consumer_kit.identity.make_scope`);
for a request:

* tenant = the authenticated client the API's ``client`` function returns, with ``%`` and ``/``
  percent-encoded so that no client id can spell another scope;
* operation type = ``"<METHOD> <route template>"``, e.g. ``"POST /invoices"`` or
  ``"POST /orders/{order_id}/refunds"`` (the template, not the path: every order's refunds share
  one scope, told apart by key and fingerprint), with the prefix the route is mounted or included
  under; an endpoint may name its operation type instead;
* version = the policy's API version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from consumer_kit.errors import ConfigurationError, InvalidMessage
from consumer_kit.identity import MAX_SCOPE_PART_LENGTH, normalize_key
from consumer_kit.model.identity import OperationIdentity


def scope_tenant(client: str) -> str:
    """``client`` as the tenant part of a scope: NFC, with ``%`` -> ``%25`` and ``/`` -> ``%2F``.

    Raises:
        ConfigurationError: an empty client, one with control characters, or one longer than
            200 characters: the API's ``client`` function must return an authenticated id.
    """
    try:
        normalized = normalize_key(client, what="client id")
    except InvalidMessage as exc:
        raise ConfigurationError(f"the API's client function returned an unusable id: {exc.detail}") from None
    escaped = normalized.replace("%", "%25").replace("/", "%2F")
    if len(escaped) > MAX_SCOPE_PART_LENGTH:
        raise ConfigurationError(f"client id of {len(escaped)} characters (max {MAX_SCOPE_PART_LENGTH})")
    return escaped


def route_template(request: Request) -> str:
    """The template of the route serving ``request`` with the prefix it is mounted or included
    under, e.g. ``"/api/orders/{order_id}/refunds"``.

    The prefix is what the request path holds before the route's own part (the route's template
    with this request's path parameters in it); where that cannot be told, the route's template
    alone.

    Raises:
        ConfigurationError: no route in the request scope (the endpoint is not served by a
            Starlette or FastAPI router).
    """
    route = request.scope.get("route")
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    if not isinstance(template, str):
        raise ConfigurationError("an idempotent endpoint must be served by a Starlette or FastAPI route")
    own_part = _filled(template, request.path_params)
    path = request.scope.get("path", "")
    root_path = request.scope.get("root_path", "")
    if path.startswith(root_path):
        path = path[len(root_path):]
    prefix = path[: -len(own_part)] if own_part and path.endswith(own_part) else ""
    return f"{root_path}{prefix}{template}"


def request_identity(
    *,
    client: str,
    method: str,
    template: str,
    api_version: int,
    key: str,
    fingerprint: str,
    projection_version: int,
    operation_type: str | None = None,
) -> OperationIdentity:
    """The ledger identity of one request (module docstring)."""
    return OperationIdentity(
        tenant=scope_tenant(client),
        operation_type=operation_type or f"{method.upper()} {template}",
        version=api_version,
        key=key,
        fingerprint=fingerprint,
        projection_version=projection_version,
    )


def _filled(template: str, params: Mapping[str, Any]) -> str:
    """``template`` with ``{name}`` and ``{name:converter}`` replaced by ``params``' values."""
    text = template
    for name, value in params.items():
        for placeholder in (f"{{{name}}}", *(f"{{{name}:{kind}}}" for kind in ("int", "str", "path", "float", "uuid"))):
            text = text.replace(placeholder, str(value))
    return text
