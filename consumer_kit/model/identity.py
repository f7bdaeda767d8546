"""Who an operation is: its scope, key and fingerprint (computed by :mod:`consumer_kit.identity`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class OperationIdentity:
    """Who an operation is: ``scope`` + ``key`` identify it, ``fingerprint`` says what it intends."""

    tenant: str
    operation_type: str
    version: int
    key: str
    fingerprint: str
    projection_version: int

    @functools.cached_property
    def scope(self) -> str:  # read several times per delivery: made once (the fields never change)
        return make_scope(self.tenant, self.operation_type, self.version)


def make_scope(tenant: str, operation_type: str, version: int) -> str:
    """``"<tenant>/<operation_type>/v<version>"``, e.g. ``"acme/invoice.create/v1"``."""
    return f"{tenant}/{operation_type}/v{version}"
