"""Who may use the console, and proof that a state-changing request came from its own page.

- **Authentication**, on every request: the console's token (``Authorization: Bearer <token>``,
  or the ``ck_console`` cookie that ``/?token=<token>`` sets once), or, when the console is told to
  trust one, a reverse proxy's authenticated-user header (the proxy must set it and strip any that
  a client sent). Anything else: 401, nothing read.
- **CSRF**: every form carries a token, an HMAC of the authenticated identity under a key made at
  start; a POST without it (or with another's) is refused with 403, as is a POST whose ``Origin``
  names another site. Cookies are ``HttpOnly; SameSite=Strict``.

Tokens are compared in constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

COOKIE = "ck_console"
CSRF_FIELD = "csrf"


@dataclass(frozen=True)
class Identity:
    """Who is asking: ``user`` (the proxy's user, or ``None`` for the token holder) and the secret
    the CSRF token is bound to."""

    user: str | None
    binding: str


class Guard:
    """Checks requests against ``token`` (or the proxy's ``user_header``, when set)."""

    def __init__(self, token: str, user_header: str | None = None) -> None:
        self.token = token
        self.user_header = user_header.lower() if user_header else None
        self._csrf_key = secrets.token_bytes(32)

    def identify(self, request: Request) -> Identity | None:
        """The request's identity, or ``None`` when it proves none."""
        if self.user_header is not None:
            user = request.headers.get(self.user_header, "").strip()
            return Identity(user, "user:" + user) if user else None
        offered = _bearer(request) or request.cookies.get(COOKIE) or request.query_params.get("token")
        if offered and hmac.compare_digest(offered.encode(), self.token.encode()):
            return Identity(None, "token")
        return None

    def csrf_token(self, identity: Identity) -> str:
        """The CSRF token the pages put in their forms for ``identity``."""
        return hmac.new(self._csrf_key, identity.binding.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, identity: Identity, offered: str | None) -> bool:
        return bool(offered) and hmac.compare_digest(str(offered), self.csrf_token(identity))


def same_origin(request: Request) -> bool:
    """``False`` when the request names an ``Origin`` other than the console's own host."""
    origin = request.headers.get("origin")
    if not origin or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host", "")


def _bearer(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None
