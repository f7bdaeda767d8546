"""Secrets out of logs, errors and CLI lines: every form a connection secret takes here.

``redact(text)`` masks, with ``***``:

==========================  ===========================================================================
form                        example (accepted by)
==========================  ===========================================================================
URL user information        ``postgresql://app:hunter2@db/app``, ``amqps://u:p@host/vhost`` (psycopg,
                            aio-pika): the password, to the line's last ``@`` (spaces, ``/``, ``?``,
                            ``#`` in it too); the user name stays (it says *who*); a NATS token
                            ``nats://TOKEN@host`` (nats-py) is masked whole
URL fragment parameters     ``...#password=x`` as a query parameter
URL query parameters        ``...?password=x``, ``?sslpassword=x``, ``?aws_secret_access_key=x``: the
                            value of any parameter whose name says secret (:data:`SECRET_NAMES`)
libpq ``key=value`` DSN     ``host=db user=app password=hunter2 dbname=app``, ``password='a b\\' c'``
                            (psycopg): the value, quoted or not
``;``-separated strings     ``Endpoint=sb://ns/;SharedAccessKeyName=k;SharedAccessKey=v``
                            (azure-servicebus): ``SharedAccessKey`` and ``SharedAccessSignature``
==========================  ===========================================================================

Parameter names are matched without regard to case. The rule errs on the side of masking: a
value of a parameter named like a secret is masked wherever it stands in the text.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

MASK = "***"

SECRET_NAMES = (
    "password", "passwd", "pwd", "sslpassword", "secret", "secret_key", "secretkey",
    "secret_access_key", "aws_secret_access_key", "access_key_secret", "sharedaccesskey",
    "sharedaccesssignature", "sas", "sig", "signature", "token", "session_token",
    "aws_session_token", "api_key", "apikey", "client_secret",
)
"""Parameter names (lower case) whose values are secrets in any of the forms above."""

_NAMES = "|".join(sorted((re.escape(name) for name in SECRET_NAMES), key=len, reverse=True))
# name=value inside a query string, a libpq DSN or a ;-separated connection string. The name must
# start the text or follow a separator, so "user=app" never matches "password" by accident. A
# libpq value may be single-quoted with backslash escapes; otherwise it runs to the next
# separator (space, &, ;) or the end.
_PARAMETER = re.compile(
    rf"(?P<lead>(?:^|[\s?&;#]))(?P<name>{_NAMES})(?P<eq>\s*=\s*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'?|[^\s&;]*)",
    re.IGNORECASE,
)
# scheme://user:password@host: the password runs to the last "@" on the line before another URL,
# so an unescaped space, "/", "?", "#" or "@" in it (a base64 password) is masked whole.
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/?#@:\s]*):(?P<password>(?:(?!://)[^\n])*)@")
# nats://TOKEN@host: nats-py takes user information without a ":" as a token.
_NATS_TOKEN = re.compile(r"(?P<head>\b(?:nats|tls)://)(?P<token>[^/?#@:\s]+)@", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with every password and key in it replaced by ``***`` (forms in the module
    docstring). Never raises; text without secrets comes back unchanged."""
    masked = _USERINFO.sub(lambda m: f"{m.group('head')}:{MASK}@", text)
    masked = _NATS_TOKEN.sub(lambda m: f"{m.group('head')}{MASK}@", masked)
    return _PARAMETER.sub(_mask_parameter, masked)


def redact_url(url: str) -> str:
    """A broker or database URL (or libpq DSN, or connection string) fit for a log line or an
    error message: :func:`redact` of it; ``"<unparsable URL>"`` where a URL cannot be parsed
    (its text might hide a secret where the rules above do not look). A libpq multi-host URL
    (``postgresql://u@h1:5432,h2:5432/db``) is parsed host by host."""
    if "://" in url:
        try:
            netloc = urlsplit(url).netloc
            hosts = netloc.rpartition("@")[2]
            for host in hosts.split(",") if url.startswith(("postgresql://", "postgres://")) else [hosts]:
                urlsplit("//" + host).port  # noqa: B018 - raises ValueError for a malformed host
        except ValueError:
            return "<unparsable URL>"
    return redact(url)


def _mask_parameter(match: re.Match[str]) -> str:
    value = match.group("value")
    if not value:
        return match.group(0)
    return f"{match.group('lead')}{match.group('name')}{match.group('eq')}{MASK}"
