"""The ``database`` group: where the ledger and the outbox live, and the keys of the marks.

Read by every command that touches PostgreSQL (``migrate``, ``ledger``, ``stats``, ``prune``, the
worker, the relay); ``consumer-kit migrate`` reads nothing else, so a bad worker setting cannot
break it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from .fields import GroupSettings, example

EMBEDDED = "embedded"
"""``CONSUMER_KIT_DATABASE_URL=embedded``: use the embedded PostgreSQL (pgserver), on purpose."""

URL_SCHEMES = ("postgresql", "postgres")
"""The schemes of a libpq connection URI (a ``key=value`` DSN has none)."""

_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://")

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class DatabaseSettings(GroupSettings):
    """Where the ledger and the outbox live: all that ``consumer-kit migrate`` reads.

    Every field is an environment variable, e.g. ``CONSUMER_KIT_DATABASE_URL``.

    Raises (on construction):
        pydantic.ValidationError: a value out of range (:meth:`from_environment` says it in
            one line per setting instead).
    """

    model_config = SettingsConfigDict(hide_input_in_errors=True)  # a URL's password: not in its text

    database_url: str | None = example(
        "postgresql://user:password@db.example:5432/app",
        "PostgreSQL URL, or 'embedded' for an embedded PostgreSQL (pgserver) under"
        " embedded_data_dir. Unset or blank: the worker, the relay and migrate refuse to start, so a"
        " forgotten URL never puts real messages into a throwaway database; in-process runs"
        " (the demo, tests with memory://) use the embedded one.",
    )
    db_schema: str = example(
        "consumer_kit", "Schema of the ledger and outbox (a plain SQL identifier).", default="consumer_kit"
    )
    embedded_data_dir: Path = Field(
        default=Path(".consumer-kit/pgdata"), description="Data directory of the embedded PostgreSQL."
    )
    database_pooler: Literal["none", "transaction"] = example(
        "transaction",
        "What sits between consumer-kit and PostgreSQL. 'none': a direct connection (or a pooler in"
        " session mode). 'transaction': a pooler in transaction mode (PgBouncer pool_mode ="
        " transaction, RDS Proxy, Supavisor): no options startup parameter and no prepared"
        " statements; lock_timeout, idle_in_transaction_session_timeout and search_path are set in"
        " every transaction instead (docs/scaling.md).",
        default="none", rule="must be 'none' or 'transaction'",
    )
    mark_key: SecretStr | None = Field(
        default=None, min_length=16,
        description="Key (at least 16 characters) that signs consumer-kit's marks on the copies it sends."
        " Unset: the random key `consumer-kit migrate` keeps in the schema's mark_keys table.",
    )
    mark_key_previous: SecretStr | None = Field(
        default=None, min_length=16,
        description="While rotating mark_key: the previous key, still accepted on marks (never signs).",
    )

    @field_validator("database_url", mode="before")
    @classmethod
    def _database_url(cls, value: object) -> object:
        """Blank (``CONSUMER_KIT_DATABASE_URL=``) is unset: never libpq's defaults. A URL names
        the scheme libpq reads (``postgresql+asyncpg://`` is SQLAlchemy's, not a libpq URL)."""
        if not isinstance(value, str):
            return value
        if not value.strip():
            return None
        url = _URL.match(value.strip())
        if url and url.group("scheme") not in URL_SCHEMES:
            raise ValueError(f"must start with postgresql:// or postgres:// (got {url.group('scheme')!r})")
        return value

    @field_validator("db_schema")
    @classmethod
    def _schema_is_identifier(cls, value: str) -> str:
        if not _IDENTIFIER.fullmatch(value):
            raise ValueError("must be a plain SQL identifier (letters, digits, _; <= 63 chars)")
        return value

    @property
    def embedded(self) -> bool:
        """True when ``database_url`` is ``embedded`` (asked for) or unset (in-process runs)."""
        return self.database_url is None or self.database_url.strip().lower() == EMBEDDED
