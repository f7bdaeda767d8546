"""Who may use the console, and proof that a state-changing request came from its own page.

- **Authentication**, on every request: the console's token (``Authorization: Bearer <token>``,
  or the ``ck_console`` cookie that ``/?token=<token>`` sets once), or, when the console is told to
  trust one, a reverse proxy's authenticated-user header, believed only on a request that proves
  it came through that proxy (its shared secret in ``X-Console-Proxy-Secret``, and/or a listed
  source address) and carries exactly one line of it. Anything else: 401, nothing read.
- **Host**: a request whose ``Host`` is not one of the served names is refused with 421 (a page
  reached by DNS rebinding is never served); docs/how-to/console.md says what to list.
- **CSRF**: every form carries a token, an HMAC of the authenticated identity under a key made at
  start; a POST without it (or with another's) is refused with 403, as is a POST whose ``Origin``
  names another site. Cookies are ``HttpOnly; SameSite=Strict``.

Tokens are compared in constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

COOKIE = "ck_console"
CSRF_FIELD = "csrf"
PROXY_SECRET_HEADER = "x-console-proxy-secret"
LOCAL_NAMES = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Identity:
    """Who is asking: ``user`` (the proxy's user, or ``None`` for the token holder) and the secret
    the CSRF token is bound to."""

    user: str | None
    binding: str


class Guard:
    """Checks requests against ``token``, or, when ``user_header`` is set, the proxy's header on a
    request from the trusted proxy.

    Args:
        token: the console's token (asked for when ``user_header`` is ``None``).
        user_header: the authenticating proxy's user header (case-insensitive).
        proxy_secret: the secret the proxy sends in ``X-Console-Proxy-Secret``.
        trusted_proxies: the proxy's source addresses or networks (``"10.0.0.5"``, ``"10.1.0.0/24"``).
        served_names: the host names the console answers to (``Host`` without its port).

    Raises:
        ValueError: ``user_header`` without ``proxy_secret`` or ``trusted_proxies`` (any client
            could then name any user), or an entry of ``trusted_proxies`` that is no address.
    """

    def __init__(self, token: str, user_header: str | None = None, *, proxy_secret: str | None = None,
                 trusted_proxies: Iterable[str] = (), served_names: Iterable[str] = LOCAL_NAMES) -> None:
        self.token = token
        self.user_header = user_header.lower() if user_header else None
        self.proxy_secret = proxy_secret or None
        self.trusted = tuple(ipaddress.ip_network(item, strict=False) for item in trusted_proxies)
        if self.user_header is not None and self.proxy_secret is None and not self.trusted:
            raise ValueError(
                "a user header is trusted only from the proxy: set CONSUMER_KIT_CONSOLE_PROXY_SECRET "
                "and/or CONSUMER_KIT_CONSOLE_TRUSTED_PROXIES"
            )
        self.served_names = frozenset(name.strip("[]").lower() for name in served_names)
        self._csrf_key = secrets.token_bytes(32)

    def host_ok(self, request: Request) -> bool:
        """``True`` when the request's one ``Host`` header names a served name (any port)."""
        hosts = request.headers.getlist("host")
        if len(hosts) != 1:
            return False
        name = urlsplit("//" + hosts[0]).hostname
        return name is not None and name.lower() in self.served_names

    def identify(self, request: Request) -> Identity | None:
        """The request's identity, or ``None`` when it proves none."""
        if self.user_header is not None:
            users = request.headers.getlist(self.user_header)
            user = users[0].strip() if len(users) == 1 and self._from_proxy(request) else ""
            return Identity(user, "user:" + user) if user else None
        offered = _bearer(request) or request.cookies.get(COOKIE) or request.query_params.get("token")
        if offered and hmac.compare_digest(offered.encode(), self.token.encode()):
            return Identity(None, "token")
        return None

    def _from_proxy(self, request: Request) -> bool:
        """The request came through the trusted proxy: every configured proof holds."""
        if self.trusted:
            client = request.client.host if request.client else ""
            try:
                address = ipaddress.ip_address(client)
            except ValueError:
                return False
            if not any(address in network for network in self.trusted):
                return False
        if self.proxy_secret is not None:
            secrets_sent = request.headers.getlist(PROXY_SECRET_HEADER)
            if len(secrets_sent) != 1 or not hmac.compare_digest(
                    secrets_sent[0].encode(), self.proxy_secret.encode()):
                return False
        return True

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
