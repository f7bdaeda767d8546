"""The ``console`` group: the settings of ``consumer-kit console`` (the operator's web console)
beyond the ``worker`` group it reads for the database and the broker. Its address and port are
command-line options (``--host``, ``--port``)."""

from __future__ import annotations

from pydantic import Field, SecretStr

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
