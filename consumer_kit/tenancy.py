"""The tenant allow-list: which broker-authenticated senders may act for which tenants.

A header is whatever the producer wrote; ``Envelope.sender`` is what the broker authenticated
(RabbitMQ's validated ``user_id``, SQS's ``SenderId``). ``Handler.tenant_senders`` ties the two
together so that a producer cannot claim another tenant's operation keys (docs/explanation/trust.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from consumer_kit.codec.envelope import TENANT_HEADER, Envelope
from consumer_kit.errors import ConfigurationError, DeadLetterReason, InvalidMessage

ANY_TENANT = "*"
"""In an allow-list entry: the sender may act for every tenant (consumer-kit's own identities)."""

TenantSenders = Mapping[str, Collection[str]]
"""``{authenticated sender: tenant names it may act for}``."""


def check_tenant_senders(allowed: TenantSenders | None, *, owner: str) -> None:
    """Refuse a malformed allow-list at start-up (a bare string would be read as its characters).

    Raises:
        ConfigurationError: not ``None`` nor ``{non-empty str: collection of non-empty str}``.
    """
    if allowed is None:
        return
    if not isinstance(allowed, Mapping) or not all(
        isinstance(sender, str) and sender and not isinstance(tenants, str | bytes)
        and isinstance(tenants, Collection) and all(isinstance(t, str) and t for t in tenants)
        for sender, tenants in allowed.items()
    ):
        raise ConfigurationError(
            f"{owner}.tenant_senders must map each authenticated sender (a non-empty string) to a "
            "set of tenant names, e.g. {'billing-producer': {'acme'}}"
        )


def refuse_tenant(allowed: TenantSenders | None, tenant: str, envelope: Envelope, *, owner: str) -> None:
    """Nothing when ``allowed`` is ``None`` or lists ``tenant`` (or ``"*"``) for ``envelope.sender``.

    Raises:
        InvalidMessage: ``invalid_header`` naming ``tenant-id`` otherwise, a delivery without an
            authenticated sender included (ids only in the detail, quoted with ``repr``).
    """
    if allowed is None:
        return
    sender = envelope.sender
    tenants = allowed.get(sender, ()) if sender is not None else ()
    if tenant in tenants or ANY_TENANT in tenants:
        return
    who = "no authenticated sender" if sender is None else f"sender {sender[:200]!r}"
    raise InvalidMessage(
        DeadLetterReason.INVALID_HEADER,
        f"{TENANT_HEADER} {tenant[:200]!r} is not allowed for {who} ({owner}.tenant_senders)",
    )
