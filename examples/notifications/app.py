"""Welcome e-mails through a provider that does not deduplicate: the external-effects example.

The handler declares ``external_effects = True`` (the leased path): the operation is claimed and
committed first, then the handler records its intent, calls the provider with a downstream key
derived from the operation, records the provider's message id, and writes its local row and the
``WelcomeSent`` event in the completion transaction (``await ctx.begin()``). If the worker dies
during the call, or the provider accepts and then times out, the next delivery takes the lease over
and ``reconcile`` asks the provider whether a message with that reference went out: sent ->
finish without sending again; not sent -> send; provider unreachable -> park for an operator.

``PROVIDER_URL`` (default ``http://127.0.0.1:8025``) names the provider; queue ``notifications.commands``.
"""

from __future__ import annotations

import os
from typing import Any

import httpx
from psycopg import AsyncConnection
from pydantic import BaseModel, Field

from consumer_kit import App, Context, Envelope, Evidence, Handler, Reconciled, Result

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS welcome_emails (
    user_id             bigint PRIMARY KEY,
    provider_message_id text NOT NULL,
    sent_at             timestamptz NOT NULL DEFAULT now()
);
"""


class SendWelcome(BaseModel):
    user_id: int
    email: str = Field(min_length=3, max_length=320)


class WelcomeSent(BaseModel):
    user_id: int
    provider_message_id: str


class ProviderUnavailable(Exception):
    """The provider could not be asked (a lookup failed): whether a send happened is unknown."""


class ProviderClient:
    """The provider's HTTP API, with a short timeout: a timeout is not a failed send."""

    def __init__(self, url: str | None = None, timeout: float = 2.0) -> None:
        self.url = url or os.environ.get("PROVIDER_URL", "http://127.0.0.1:8025")
        self.timeout = timeout

    async def send(self, *, to: str, template: str, reference: str) -> str:
        """Send one e-mail; returns the provider's message id.

        Raises:
            httpx.HTTPError: no answer in time, or refused (the e-mail may still have gone out).
        """
        async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout) as client:
            response = await client.post("/v1/messages", json={"to": to, "template": template, "reference": reference})
            response.raise_for_status()
            return str(response.json()["id"])

    async def find(self, reference: str) -> list[dict[str, Any]]:
        """The messages sent with ``reference``.

        Raises:
            ProviderUnavailable: the lookup failed.
        """
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=self.timeout) as client:
                response = await client.get("/v1/messages", params={"reference": reference})
                response.raise_for_status()
        except httpx.HTTPError as exc:
            raise ProviderUnavailable(f"{type(exc).__name__}") from exc
        return list(response.json()["messages"])


class WelcomeEmailHandler(Handler[SendWelcome]):
    operation_type = "email.welcome"
    external_effects = True  # the leased path: claim first, then the call, then the completion

    def __init__(self, provider: ProviderClient | None = None) -> None:
        super().__init__()
        self.provider = provider or ProviderClient()

    def operation_key(self, message: SendWelcome, envelope: Envelope) -> str:
        return f"welcome-{message.user_id}"

    async def handle(self, message: SendWelcome, ctx: Context) -> Result:
        reference = ctx.downstream_key("send")  # the same on every attempt and every worker
        await ctx.record_evidence("send", intent="welcome", reference=reference)
        provider_id = await self.provider.send(to=message.email, template="welcome", reference=reference)
        await ctx.record_evidence("send", provider_message_id=provider_id)
        return await self._record_sent(message, ctx, provider_id)

    async def reconcile(self, message: SendWelcome, evidence: Evidence, ctx: Context) -> Reconciled:
        if not evidence.started("send"):
            return Reconciled.not_done()  # the previous attempt died before calling
        try:
            found = await self.provider.find(ctx.downstream_key("send"))
        except ProviderUnavailable as exc:
            return Reconciled.unknown(f"the provider could not be asked ({exc})")
        if not found:
            return Reconciled.not_done()  # safe to send again with the same reference
        return Reconciled.done(await self._record_sent(message, ctx, found[0]["id"]))

    async def _record_sent(self, message: SendWelcome, ctx: Context, provider_id: str) -> Result:
        conn = await ctx.begin()  # commits with the ledger's completion and the event
        await conn.execute(
            "INSERT INTO welcome_emails (user_id, provider_message_id) VALUES (%s, %s)",
            (message.user_id, provider_id),
        )
        await ctx.publish(
            WelcomeSent(user_id=message.user_id, provider_message_id=provider_id),
            destination="users.events", routing_key="welcome.sent", partition_key=str(message.user_id),
        )
        return Result("sent", reference=provider_id)


async def create_tables(conn: AsyncConnection[Any]) -> None:
    await conn.execute(SCHEMA_SQL)


app = App("notifications")
app.subscribe("notifications.commands", WelcomeEmailHandler())
app.on_startup(create_tables)
