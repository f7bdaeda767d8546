"""The ``console`` group: the settings of ``consumer-kit console`` (the operator's web console)
beyond the ``worker`` group it reads for the database and the broker. Its address and port are
command-line options (``--host``, ``--port``)."""

from __future__ import annotations

import ipaddress

from pydantic import Field, SecretStr, field_validator

from .fields import GroupSettings

MIN_TOKEN_CHARS = 16


class OperatorConsoleSettings(GroupSettings):
    """``CONSUMER_KIT_CONSOLE_*``: how operators sign in to the web console.

    Raises (on construction):
        pydantic.ValidationError: a token shorter than :data:`MIN_TOKEN_CHARS`.
    """

    console_token: SecretStr | None = Field(
        default=None, min_length=MIN_TOKEN_CHARS,
        description=f"Token the console asks for (at least {MIN_TOKEN_CHARS} characters, e.g. from"
        " `openssl rand -hex 24`). Unset: a random one, printed once in the URL to open.",
        json_schema_extra={"example": "output of openssl rand -hex 24",
                           "rule": f"must be at least {MIN_TOKEN_CHARS} characters"},
    )
    console_proxy_secret: SecretStr | None = Field(
        default=None, min_length=MIN_TOKEN_CHARS,
        description="With --user-header: the secret the authenticating proxy sends in the"
        " X-Console-Proxy-Secret header (at least 16 characters); a request without it is refused.",
        json_schema_extra={"example": "output of openssl rand -hex 24",
                           "rule": f"must be at least {MIN_TOKEN_CHARS} characters"},
    )
    console_trusted_proxies: list[str] = Field(
        default=[],
        description="With --user-header: the proxy's source addresses or networks, as a JSON list; a"
        " request from any other address is refused.",
        json_schema_extra={"example": '["10.0.0.5", "10.1.0.0/24"]'},
    )
    console_served_names: list[str] = Field(
        default=[],
        description="Host names the console answers to, as a JSON list (the Host header a proxy"
        " forwards); any other Host is refused (DNS rebinding). Default: the listen address and"
        " localhost.",
        json_schema_extra={"example": '["console.example.com"]'},
    )

    @field_validator("console_trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for item in value:
            ipaddress.ip_network(item, strict=False)  # ValueError: not an address or network
        return value
