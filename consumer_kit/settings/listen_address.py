"""The address a server of consumer-kit's listens on (the health and the metrics endpoint): a
settings field for it and the rule it must follow."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from pydantic import Field

_HOST_RULE = "must be an IP address or a host name to listen on, without port or scheme"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")  # RFC 1123 labels, dot-separated


def listen_host(default: str, description: str) -> Any:
    """A field naming the address a server listens on: an IPv4 or IPv6 address (``0.0.0.0``,
    ``::``, ``[::1]``) or a host name (``localhost``); validated by :func:`check_host`."""
    return Field(
        default=default, description=description,
        json_schema_extra={"example": "127.0.0.1, 0.0.0.0 or ::", "rule": _HOST_RULE},
    )


def check_host(value: str) -> str:
    """``value`` as a server's listen address: an IP address (brackets around IPv6 dropped) or a
    host name.

    Raises:
        ValueError: anything else (a port, a scheme, a space, an empty string).
    """
    text = value.strip()
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if _HOST_NAME.fullmatch(text) and not text.replace(".", "").isdigit():  # "300.1.1.1" is no name
        return text
    raise ValueError(_HOST_RULE)
