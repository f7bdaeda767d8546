"""What a write of an operation's owner must still match (the ledger turns it into SQL)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRANSACTION = "transaction"
LEASE = "lease"
LEASE_AND_TRANSACTION = "lease_and_transaction"


@dataclass(frozen=True)
class Fence:
    """What a write of the operation's owner must still match: the claiming transaction
    (``kind == TRANSACTION``, ``xid``) or the lease (``kind == LEASE``, ``owner`` and ``attempt``,
    the fencing token)."""

    kind: str
    xid: str | None = None
    owner: str | None = None
    attempt: int | None = None

    @classmethod
    def of_transaction(cls, xid: str) -> Fence:
        return cls(TRANSACTION, xid=xid)

    @classmethod
    def of_lease(cls, owner: str, attempt: int) -> Fence:
        return cls(LEASE, owner=owner, attempt=attempt)

    def within_transaction(self, xid: str) -> Fence:
        """This lease fence, also bound to the completion transaction ``xid``."""
        return Fence(LEASE_AND_TRANSACTION, xid=xid, owner=self.owner, attempt=self.attempt)

    def params(self) -> dict[str, Any]:
        if self.kind == TRANSACTION:
            return {"xid": self.xid}
        if self.kind == LEASE:
            return {"owner": self.owner, "attempt": self.attempt}
        return {"xid": self.xid, "owner": self.owner, "attempt": self.attempt}
